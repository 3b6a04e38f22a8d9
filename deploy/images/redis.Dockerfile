# redis-server as the same unprivileged user as every other container: it owns /data (the AOF), so
# a new named volume there does too, and it can read the 0600 ACL file `ito-training secrets` wrote.
FROM redis:6.2
ARG ITO_UID=10001
RUN mkdir -p /data && chown "${ITO_UID}:${ITO_UID}" /data
USER ${ITO_UID}:${ITO_UID}
