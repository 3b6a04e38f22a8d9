# nats-server as an unprivileged user: the image's /data belongs to ITO_UID, so a new named volume
# mounted there does too (Docker copies the mount point's owner). Alpine: busybox `nc` for the
# healthcheck (the server's INFO line; the monitoring port stays off).
FROM nats:2.10-alpine
ARG ITO_UID=10001
RUN mkdir -p /data && chown "${ITO_UID}:${ITO_UID}" /data
USER ${ITO_UID}:${ITO_UID}
