# One image for every service; compose.yaml picks the service with `ito-training serve NAME`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY services ./services
COPY ecc ./ecc
# torch first, pinned exactly (a range would pull a multi-GB CUDA build).
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir -e .
ENV ITO_DATA_DIR=/data
ENTRYPOINT ["ito-training"]
