import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
#: the folder of the multi-process scripts (``<launch>_<subject>.py``: ``ddp_*`` a case of the
#: session's DDP launch or the contract's, ``fsdp_*`` a part of the FSDP launch)
MULTIPROCESS = HERE / "multiprocess"
# the test folders mirror the package; their modules import each other and the support modules
# of tests/ by their (unique) names, so every folder is on the path, in this process and in
# subprocesses (DDP ranks, CLI runs), which import this checkout's package too
FOLDERS = sorted({p.parent for p in HERE.rglob("*.py")})  # tests/ first
sys.path[:0] = [str(p) for p in FOLDERS if str(p) not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent), *map(str, FOLDERS), *filter(None, [os.environ.get("PYTHONPATH")])]
)
os.environ.setdefault("PL_DISABLE_FORK", "1")
# under pytest-xdist each worker takes its share of the cores (2 workers on 2 cores: 1 each)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, torch.get_num_threads()) // _WORKERS)
torch.set_num_threads(_THREADS)
# and keeps it: where OMP_NUM_THREADS is unset, Lightning's launchers set torch's threads to the
# cores per process (an in-process DDP or FSDP fit on one device: both cores), so that each worker
# went on with 2 threads on 2 shared cores, whose spinning made its later small ops 10-20x dearer
os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


@pytest.fixture(autouse=True)
def _thread_count_kept():
    yield
    if torch.get_num_threads() != _THREADS:  # a test or a library changed it: put it back
        torch.set_num_threads(_THREADS)


def _needs_deepspeed_extensions(item) -> bool:
    return "ZeROOffload" in item.nodeid or item.get_closest_marker("deepspeed") is not None


def pytest_collection_modifyitems(config, items):
    for item in items:
        # two-process DDP fits spawn fresh interpreters (imports, process group): the slowest
        # tests of the suite; `-m "not slow"` is the quick local loop, CI runs everything
        if getattr(item, "originalname", "") == "test_ddp_two_processes":
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# an in-process fit that left Lightning's launcher variables would make a child process started
# by a later test think it was launched already (LOCAL_RANK) and wait for its peers
@pytest.fixture(autouse=True)
def _no_launcher_variables_leak():
    from lightning_efficient.core.environ import launcher_environ, restore_environ

    before = launcher_environ()
    yield
    restore_environ(before)


class _Tee:
    """A text stream that writes through to ``stream`` and keeps what was written."""

    def __init__(self, stream) -> None:
        self.stream, self.text = stream, []

    def write(self, text: str) -> int:
        self.text.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


@dataclass
class ExtensionsReady:
    """What the session's :func:`ensure_extensions` call did (``extensions``: name, folder and
    status per extension, and ``again``: its status at a second call in the same process) and the
    lines each call announced. On a clean machine the first call is the build, which a test
    observes in place of paying a second one; under pytest-xdist the worker that made it shares
    the record with the others."""

    extensions: list[dict]
    announced: list[str]
    second_announced: list[str]


def _ensure_extensions_recorded(_folder: Path) -> dict:
    from lightning_efficient.techniques.zero_offload.extensions import ensure_extensions

    out, again = _Tee(sys.stderr), _Tee(sys.stderr)
    first, second = ensure_extensions(out=out), ensure_extensions(out=again)
    return {
        "extensions": [
            {"name": e.name, "folder": str(e.folder or ""), "status": e.status, "again": s.status}
            for e, s in zip(first, second, strict=True)
        ],
        "announced": "".join(out.text).splitlines(),
        "second_announced": "".join(again.text).splitlines(),
    }


@pytest.fixture(scope="session")
def deepspeed_extensions(tmp_path_factory) -> ExtensionsReady:
    """DeepSpeed's CPU extensions, built once per session before a test needs them and outside
    any timed part (a fresh machine compiles them for minutes), by the function that
    `lightning-efficient prepare` runs; in the folder the tests will use ($TORCH_EXTENSIONS_DIR
    or the user's cache). Once per session under pytest-xdist too: the other workers wait for
    the build and reuse the cache and the record."""
    pytest.importorskip("deepspeed")
    from helpers import once_per_session

    record = once_per_session(tmp_path_factory, "deepspeed_extensions", _ensure_extensions_recorded)
    return ExtensionsReady(**record)


def _launch_ddp_cases(folder: Path, names: list[str]) -> dict:
    from helpers import launch

    cmd = [sys.executable, str(MULTIPROCESS / "ddp_cases.py"), str(folder), ",".join(names)]
    # COLUMNS: the reports case reads its table's rows whole
    _, err, code = launch(cmd, folder, 300 * len(names), env={"COLUMNS": "200"}, stdout=False)
    return {"folder": str(folder), "returncode": code, "stderr": err[-4000:]}


@pytest.fixture
def ddp_case(request, tmp_path_factory) -> Path:
    """The folder of the test's ``ddp_case`` (``@pytest.mark.ddp_case(name)``), run on 2 CPU
    processes in the session's one launch of ``tests/multiprocess/ddp_cases.py``: every case the
    session collected, one after another in the same two processes, started by the first test
    that asks (under pytest-xdist too: ``once_per_session``). Fails with the case's own error
    output, or the launch's, where the case did not finish."""
    from ddp_cases import CASES
    from helpers import once_per_session

    name = request.node.get_closest_marker("ddp_case").args[0]
    wanted = {m.args[0] for item in request.session.items for m in item.iter_markers("ddp_case")}
    names = [n for n in CASES if n in wanted]  # in the launch's order: the sharded fits last
    result = once_per_session(
        tmp_path_factory, "ddp_cases", lambda folder: _launch_ddp_cases(folder, names)
    )
    out = Path(result["folder"]) / name
    if not (out / "done").exists():
        own = "".join(p.read_text()[-3000:] for p in sorted(out.glob("rank*.err")))
        code = result["returncode"]
        pytest.fail(
            f"the two-process case {name!r} did not finish (the launch of {names} "
            f"{'timed out' if code is None else f'ended with {code}'}).\n"
            f"{own or 'It did not start: an earlier case failed.'}\n{result['stderr']}"
        )
    return out


@pytest.fixture(autouse=True)
def _deepspeed_extensions_before_timed_tests(request):
    # ZeROOffload's contract cases (a 2-process DDP run under a timeout among them) and tests
    # marked `deepspeed` get the extensions first
    if _needs_deepspeed_extensions(request.node):
        request.getfixturevalue("deepspeed_extensions")
