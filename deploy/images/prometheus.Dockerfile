# Prometheus as ITO_UID: it reads the 0600 metrics token (`authorization.credentials_file`) and
# owns its TSDB under /prometheus.
FROM prom/prometheus:v3.5.0
ARG ITO_UID=10001
USER root
RUN mkdir -p /prometheus && chown -R "${ITO_UID}:${ITO_UID}" /prometheus
USER ${ITO_UID}:${ITO_UID}
