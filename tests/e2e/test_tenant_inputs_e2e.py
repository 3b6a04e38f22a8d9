"""A remote tenant's own data and models, end to end (issue 39), with the client run as another,
unprivileged Unix user who cannot read the backend's data dir: it uploads a tiny Hugging Face
checkpoint (`ecc ito models upload`) and chat JSONL (`ecc ito files upload`), plans, confirms and
trains SFT on them and on an `s3://` object read through a named connection (moto's server here;
the secret stays the operator's 0600 file), exports the SFT stage and trains DPO on an uploaded
pairs file starting from `run:<first run>/sft`, then exports and downloads the result. Another
tenant can neither see nor name any of it (the answers for theirs and for what does not exist are
the same). An interrupted 1 GB upload resumes where the server stopped and its digest checks.
Every CLI and MCP answer of it is scanned: no server path, and nowhere the connection's secret,
nor in the manifests or the services' logs; the data dir and its logs are 0700 / 0600.

The client runs on Debian's own Python 3.11 (the venv's interpreter lives under /root, which the
tenant cannot enter), with copies of `ecc`, `contracts` and the client's four libraries in the
tenant's home: what such a user would have installed."""

import contextlib
import hashlib
import importlib
import json
import os
import pathlib
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid

import pytest

from runtime.storage import s3_objects
from tests.support import eventually, moto_s3

pytestmark = [pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = pathlib.Path("/usr/bin/python3")
TENANT_USER = "itotenant"
CLIENT_LIBRARIES = ("nats", "msgspec", "nkeys", "nacl", "cffi", "_cffi_backend")
BIG_BYTES = 1_000_000_000  # the interrupted upload: 1 GB
KILL_AFTER_BYTES = 150_000_000  # the first client is killed once the server holds this much
KEY_ID, SECRET = "AKIAEXAMPLETENANT000", "tenant/Bucket+Secret/KEY/never-shown-anywhere0"
RUN_TIMEOUT_S = 300
DECON = {"method": "13-gram", "against": [], "provenance": "test"}
TERMINAL = {"succeeded", "failed", "gate_failed", "cancelled"}


def _assets():
    spec = importlib.util.spec_from_file_location("finetune_assets", REPO / "examples" / "finetune_assets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("finetune_assets", module)
    spec.loader.exec_module(module)
    return module


def _tenant_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(TENANT_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", TENANT_USER],
            check=True,
        )
        return pwd.getpwnam(TENANT_USER)


def _copy_client(target: pathlib.Path) -> None:
    """`ecc`, `contracts` and the libraries the client imports, as a user would have installed them."""
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("ecc", "contracts"):
        shutil.copytree(REPO / package, target / package, ignore=ignore)
    for name in CLIENT_LIBRARIES:
        module = importlib.import_module(name)
        origin = pathlib.Path(module.__file__)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, target / origin.parent.name, ignore=ignore)
        else:
            shutil.copy2(origin, target / origin.name)


class Tenant:
    """`ecc` as the unprivileged user, with a home of its own (0700) and its outputs kept."""

    def __init__(self, stack, home: pathlib.Path, user: pwd.struct_passwd) -> None:
        self.stack, self.home, self.user = stack, home, user
        self.seen: list[str] = []
        self.env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(home / "client"),
            "ECC_CONFIG_DIR": str(home / "ecc"),
            "ECC_CONNECTION_FILE": str(home / "connection.json"),
        }

    def own(self, path: pathlib.Path) -> pathlib.Path:
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            os.chown(p, self.user.pw_uid, self.user.pw_gid)
        return path

    def command(self, *args: str) -> list[str]:
        return [str(SYSTEM_PYTHON), "-s", "-m", "ecc.main", "ito", *args]

    def run(self, *args: str, input: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            self.command(*args),
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.home,
            user=self.user.pw_uid,
            group=self.user.pw_gid,
            extra_groups=[],
            timeout=timeout,
        )
        self.seen += [proc.stdout, proc.stderr]
        return proc

    def ecc(self, *args: str, input: str | None = None, timeout: float = 180) -> tuple[int, dict]:
        proc = self.run(*args, "--json", input=input, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        assert lines, f"ecc printed nothing; stderr: {proc.stderr[-2000:]}"
        return proc.returncode, json.loads(lines[-1])

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(*args, "--json"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=self.home,
            user=self.user.pw_uid,
            group=self.user.pw_gid,
            extra_groups=[],
        )

    def manifest(self, name: str, doc: dict) -> pathlib.Path:
        path = self.home / name
        path.write_text(json.dumps(doc))
        path.chmod(0o600)
        return self.own(path)

    def wait(self, run_id: str) -> dict:
        def ended():
            rc, out = self.ecc("status", run_id)
            assert rc == 0, out
            return out["data"] if out["data"]["state"] in TERMINAL else None

        return eventually(ended, timeout=RUN_TIMEOUT_S, interval=1.0, what=f"run {run_id} to end")

    def export(self, run_id: str, *args: str) -> dict:
        def ready():
            rc, out = self.ecc("export", run_id, *args)
            assert rc == 0 and out["data"]["state"] != "failed", out
            return out["data"] if out["data"]["state"] == "ready" else None

        return eventually(ready, timeout=180, interval=1.0, what="export ready")

    def train(self, booking: str, manifest: pathlib.Path, key: str) -> str:
        rc, plan = self.ecc("plan", "--booking", booking, "--manifest", str(manifest))
        assert rc == 0 and plan["data"]["ok"], plan
        rc, conf = self.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", str(manifest))
        assert rc == 0, conf
        ref = conf["data"]["confirmation_ref"]
        args = (
            "--booking",
            booking,
            "--manifest",
            str(manifest),
            "--confirmation-ref",
            ref,
            "--idempotency-key",
            key,
        )
        rc, out = self.ecc("train", *args)
        assert rc == 0, out
        return out["data"]["run_id"]


@pytest.fixture(scope="module")
def moto_url():
    with moto_s3() as url:
        yield url


@pytest.fixture
def tenant(stack):
    if os.geteuid() != 0 or not SYSTEM_PYTHON.exists():
        pytest.skip("needs root (to run the client as another user) and Debian's /usr/bin/python3")
    user = _tenant_user()
    home = pathlib.Path(tempfile.mkdtemp(prefix="ito-tenant-", dir="/tmp"))
    try:
        home.chmod(0o700)
        _copy_client(home / "client")
        (home / "ecc").mkdir(mode=0o700)
        shutil.copy(stack.env["ECC_CONNECTION_FILE"], home / "connection.json")  # no secret in it
        t = Tenant(stack, home, user)
        t.own(home)
        yield t
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _chat_rows(path: pathlib.Path, seed: int, rows: int = 120) -> str:
    fa = _assets()
    written = fa.write_chat_data(path.parent / f"gen-{seed}", rows=rows, seed=seed)["sft"]
    shutil.copy(written, path)
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tenants_own_data_and_model_in_and_out_with_nothing_of_the_servers_shown(
    stack, tenant, moto_url, tmp_path
):
    t = tenant
    data_dir = str(stack.data_dir)
    # the tenant cannot read the backend's data dir: nothing it does below goes through the disk
    probe = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import os, sys; os.listdir(sys.argv[1])", data_dir],
        capture_output=True,
        text=True,
        user=t.user.pw_uid,
        group=t.user.pw_gid,
        extra_groups=[],
    )
    assert probe.returncode != 0 and "PermissionError" in probe.stderr
    assert stack.data_dir.stat().st_mode & 0o777 == 0o700
    logs = stack.data_dir / "logs"
    assert logs.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in logs.glob("*.log")} == {
        p.name: 0o600 for p in logs.glob("*.log")
    }

    # the operator: two accounts, a booking, the tenant's bucket connection (a 0600 secret file)
    account = "acct-" + uuid.uuid4().hex[:8]
    key = stack.ito("accounts", "create", account)["api_key"]
    rival, _, rival_env = stack.account()
    booking = stack.booking(account)
    rival_booking = stack.booking(rival)
    secret_file = tmp_path / "corpora.json"
    secret_file.write_text(json.dumps({"access_key_id": KEY_ID, "secret_access_key": SECRET}))
    secret_file.chmod(0o600)
    stack.ito(
        "connections",
        "add",
        "corpora",
        "--account",
        account,
        "--secret-file",
        str(secret_file),
        "--endpoint-url",
        moto_url,
    )
    bucket = s3_objects.Endpoint(endpoint_url=moto_url, access_key_id=KEY_ID, secret_access_key=SECRET)
    s3_objects.client(bucket).create_bucket(Bucket="acme-corpora")
    more_chat = tmp_path / "more-chat.jsonl"
    more_digest = _chat_rows(more_chat, seed=7)
    s3_objects.client(bucket).put_object(
        Bucket="acme-corpora", Key="chat/more.jsonl", Body=more_chat.read_bytes()
    )

    # the tenant logs in (the key on stdin), brings its model and its data
    rc, out = t.ecc("login", "--account", account, input=key + "\n")
    assert rc == 0, out
    fa = _assets()
    fa.write_base_model(t.home / "base", "llama")
    files = fa.write_chat_data(t.home / "data")
    t.own(t.home / "base")
    t.own(t.home / "data")
    rc, up = t.ecc("models", "upload", str(t.home / "base"), "--name", "my-llama")
    assert rc == 0 and up["data"]["state"] == "ready", up
    base_digest = up["data"]["model"]["digest"]
    sources = {}
    for ref, name, purpose in (
        ("chat", "sft", "train"),
        ("prefs", "dpo", "train"),
        ("chat-eval", "eval", "eval"),
    ):
        rc, up = t.ecc("files", "upload", str(files[name]), "--purpose", purpose)
        assert rc == 0 and up["data"]["state"] == "ready", up
        sources[ref] = up["data"]["file"]["source"]
    rc, listed = t.ecc("files", "list")
    assert rc == 0 and len(listed["data"]["files"]) == 3
    rc, conns = t.ecc("connections")
    assert rc == 0 and [c["name"] for c in conns["data"]["connections"]] == ["corpora"]

    # run 1: SFT on the upload and on the bucket's object, through the connection
    template = json.loads((REPO / "examples" / "manifests" / "finetune.json").read_text())
    sft = fa.finetune_manifest(
        REPO / "examples" / "manifests" / "finetune.json",
        base="my-llama",
        revision=base_digest,
        sources=sources,
    )
    sft["data"].append(
        {
            "name": "more-chat",
            "source": "s3://acme-corpora/chat/more.jsonl",
            "connection": "corpora",
            "digest": more_digest,
            "role": "train",
            "decontamination": template["data"][0]["decontamination"],
        }
    )
    sft["post_training"] = {
        "recipe": ["sft"],
        "sft": {**template["post_training"]["sft"], "data": ["chat", "more-chat"]},
    }
    sft_path = t.manifest("sft.json", sft)
    run1 = t.train(booking, sft_path, "tenant-sft")
    final = t.wait(run1)
    assert final["state"] == "succeeded", final
    sft_export = t.export(run1, "--stage", "sft")

    # run 2: DPO on the uploaded pairs, starting from run 1's exported SFT stage (no operator step)
    dpo = json.loads(json.dumps(sft))
    dpo["model"] = {"base": f"run:{run1}/sft", "revision": sft_export["digest"]}
    dpo["data"] = [r for r in dpo["data"] if r["name"] in ("prefs", "chat-eval")]
    dpo["post_training"] = {"recipe": ["dpo"], "dpo": {**template["post_training"]["dpo"], "data": ["prefs"]}}
    dpo_path = t.manifest("dpo.json", dpo)
    rc, models = t.ecc("models")
    assert rc == 0 and {"my-llama", f"run:{run1}/sft"} <= {m["name"] for m in models["data"]["models"]}
    run2 = t.train(booking, dpo_path, "tenant-dpo")
    final = t.wait(run2)
    assert final["state"] == "succeeded", (final["message"], final["gates"])
    dpo_export = t.export(run2)
    assert dpo_export["export_id"] == "dpo-hf"
    rc, done = t.ecc("download", run2, "--to", str(t.home / "model"), timeout=240)
    assert rc == 0 and done["data"]["digest"] == dpo_export["digest"], done
    assert (t.home / "model" / "config.json").stat().st_uid == t.user.pw_uid
    for args in (
        ("logs", run1),
        ("logs", run2),
        ("checkpoints", run1),
        ("status", run2),
        ("runs",),
        ("evals", run2),
    ):
        rc, out = t.ecc(*args)
        assert rc == 0, out

    # another tenant can neither see nor name any of it: the same answers as for what does not exist
    def rival_ecc(*args):
        rc, out = stack.ecc(*args, env=rival_env)
        t.seen.append(json.dumps(out))
        return rc, out

    file_id = sources["chat"].removeprefix("upload:")
    rc, theirs = rival_ecc("files", "list")
    assert rc == 0 and theirs["data"]["files"] == []
    nobody = "file-" + uuid.uuid4().hex[:24]
    answers = [rival_ecc("files", "show", f)[1]["error"] for f in (file_id, nobody)]
    assert answers[0]["code"] == answers[1]["code"] == "data_not_found"
    assert answers[0]["message"].replace(file_id, "X") == answers[1]["message"].replace(nobody, "X")
    rc, theirs = rival_ecc("models")
    assert not {"my-llama", f"run:{run1}/sft"} & {m["name"] for m in theirs["data"]["models"]}
    nobody_run = "run_" + uuid.uuid4().hex[:24]
    answers = []
    for run in (run1, nobody_run):
        named = json.loads(json.dumps(dpo))
        named["model"]["base"] = f"run:{run}/sft"
        named["data"] = [
            {
                "name": "sums",
                "source": "generated:arithmetic",
                "decontamination": template["data"][0]["decontamination"],
            }
        ]
        named["post_training"] = {"recipe": ["sft"], "sft": {"steps": 2, "data": ["sums"]}}
        path = tmp_path / f"rival-{run}.json"
        path.write_text(json.dumps(named))
        path.chmod(0o600)
        rc, out = rival_ecc("plan", "--booking", rival_booking, "--manifest", str(path))
        answers.append((out["error"]["code"], out["error"]["message"].replace(run, "X")))
    assert answers[0] == answers[1] and answers[0][0] == "model_not_found"
    answers = [rival_ecc("status", r)[1]["error"] for r in (run1, nobody_run)]
    assert answers[0] == answers[1] and answers[0]["code"] == "run_not_found"
    named = json.loads(json.dumps(sft))  # A's upload by its id, in B's manifest
    named["model"] = {"size": "tiny", "revision": "r"}
    named["data"] = [dict(sft["data"][0], source=sources["chat"], decontamination=DECON)]
    named["post_training"] = {"recipe": ["sft"], "sft": {"steps": 2, "data": ["chat"]}}
    path = tmp_path / "rival-upload.json"
    path.write_text(json.dumps(named))
    path.chmod(0o600)
    rc, out = rival_ecc("plan", "--booking", rival_booking, "--manifest", str(path))
    assert rc != 0 and out["error"]["code"] == "data_not_found", out

    # an interrupted 1 GB upload resumes where the server stopped, and its digest checks
    big = t.home / "big.jsonl"
    line = (json.dumps({"text": "the river runs under the old stone bridge " * 1500}) + "\n").encode()
    with big.open("wb") as f:
        written = 0
        while written + len(line) <= BIG_BYTES:
            f.write(line)
            written += len(line)
        f.write(json.dumps({"text": "x" * (BIG_BYTES - written - 13)}).encode() + b"\n")
    t.own(big)
    assert big.stat().st_size == BIG_BYTES
    local_digest = hashlib.sha256()
    with big.open("rb") as f:
        while block := f.read(1 << 24):
            local_digest.update(block)
    first = t.popen("files", "upload", str(big))

    def held() -> int:
        rc, out = t.ecc("files", "list")
        assert rc == 0, out
        return sum(f["received"] for u in out["data"]["uploads"] for f in u["files"])

    eventually(
        lambda: held() >= KILL_AFTER_BYTES or first.poll() is not None,
        timeout=180,
        what="a part of 1 GB held",
    )
    first.send_signal(signal.SIGKILL)
    first.wait()
    stopped_at = held()
    assert KILL_AFTER_BYTES <= stopped_at < BIG_BYTES, stopped_at  # interrupted midway
    rc, again = t.ecc("files", "upload", str(big), timeout=600)
    assert rc == 0 and again["data"]["state"] == "ready", again
    assert again["notice"] and "resumed" in again["notice"]
    assert again["data"]["file"]["sha256"] == "sha256:" + local_digest.hexdigest()
    assert again["data"]["file"]["bytes"] == BIG_BYTES
    big.unlink()

    # the agents' door, as the same account: its answers too
    mcp_seen = _mcp_answers(stack, account, key, run1, file_id)

    # nothing of the server's paths in any answer; the connection's secret nowhere
    texts = t.seen + mcp_seen
    for text in texts:
        assert data_dir not in text and os.path.realpath(data_dir) not in text
        assert SECRET not in text and KEY_ID not in text
    for path in (sft_path, dpo_path):
        assert SECRET not in path.read_text() and KEY_ID not in path.read_text()
    for log in logs.glob("*.log"):
        content = log.read_text(errors="replace")
        assert SECRET not in content and KEY_ID not in content, log.name


def _mcp_answers(stack, account: str, key: str, run_id: str, file_id: str) -> list[str]:
    """Every answer of the MCP door's reads of the tenant's things (`ecc mcp`, logged in as it)."""
    import asyncio

    from tests.e2e.test_mcp import agent

    config = pathlib.Path(tempfile.mkdtemp(prefix="ecc-mcp-"))
    env = {**stack.env, "ECC_CONFIG_DIR": str(config)}
    try:
        login = stack.run("ecc", "ito", "login", "--account", account, "--json", input=key + "\n", env=env)
        assert login.returncode == 0, login.stderr

        async def calls() -> list[str]:
            async with agent(env) as a:
                for name, args in (
                    ("files", {}),
                    ("files", {"file_id": file_id}),
                    ("connections", {}),
                    ("models", {}),
                    ("status", {"run_id": run_id}),
                    ("checkpoints", {"run_id": run_id}),
                    ("logs", {"run_id": run_id}),
                    ("runs", {}),
                ):
                    out = await a(name, **args)
                    assert out["ok"], (name, out)
                return a.seen

        return asyncio.run(calls())
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(config)
