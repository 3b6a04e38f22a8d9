"""`ito-training desk serve`: the desk's web app on uvicorn. Config, build, run, close.

It reads its operator token from the secrets dir (a 0600 file; never an argument) and connects to
NATS as the desk identity. It prints where it listens once it does; the token stays in its file
(a login link with the token in its fragment is the caller's to make: see examples/demo.sh).
"""

import asyncio
import json
import socket

from runtime.configuration.settings import Settings
from runtime.security.secrets import DESK_TOKEN, SecretError, Secrets
from runtime.security.tls import Certs

DEFAULT_HOST = "127.0.0.1"  # loopback; with TLS on (ITO_TLS=1) it serves HTTPS itself
DEFAULT_PORT = 8765
GRACEFUL_S = 3  # open event streams are cut after this long on shutdown


def free_port() -> int:
    """A port nothing listens on now (the desk's own: the product image has no development stack)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(settings: Settings, host: str, port: int, as_json: bool) -> int:
    import uvicorn

    from services.desk.source import DeskSource
    from services.desk.web import build

    secrets = Secrets(settings.secrets_dir)
    token = secrets.token(DESK_TOKEN)
    try:  # a container that mounts no metrics token scrapes with the desk's alone
        scrape_token = secrets.metrics_token()
    except SecretError:
        scrape_token = ""
    port = port or free_port()
    # TLS on (ITO_TLS=1, `up --tls`, compose): HTTPS with the server certificate, no plain HTTP
    cert, key = Certs(settings.tls_dir).server_files() if settings.tls else (None, None)
    app = build(DeskSource(settings), token, scrape_token)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,  # a request line is no secret, but nothing here needs a log of them
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_S,
            ssl_certfile=cert,
            ssl_keyfile=key,
        )
    )

    async def run() -> None:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:
            url = f"{'https' if settings.tls else 'http'}://{host}:{port}"
            where = {
                "url": url + "/",
                "login": url + "/login",
                "token_file": str(secrets.token_path(DESK_TOKEN)),
            }
            print(
                json.dumps(where) if as_json else f"desk: {url}/ (operator token in {where['token_file']})",
                flush=True,
            )
        await serving

    asyncio.run(run())
    return 0 if server.started else 1
