"""``kvgate data oracle --devices 2``: two processes on the CPU (Lightning's DDP over gloo) label
a corpus of files into the labels one process writes, bit for bit; a rank killed mid-run and a
rerun continue without labelling a finished shard again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from kvtrain_fixtures import save_tiny_base, synthetic_docs

from kvgate.data.oracle import LabelStore

ROOT = Path(__file__).resolve().parents[2]
# rank 1 dies (as a lost node would) once its first shard is on disk: the kill is placed by
# the test, not timed, so the state it leaves is known
KILLER = """
import os, sys
from pathlib import Path
from kvgate.data.oracle import compute

real, calls = compute.shard_labels, []

def dying(*args, **kwargs):
    if os.environ.get("LOCAL_RANK") == "1" and calls:
        Path(os.environ["KILL_MARK"]).write_text("dead")
        os._exit(9)
    calls.append(1)
    return real(*args, **kwargs)

compute.shard_labels = dying
from kvgate.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    base = save_tiny_base(root / "base")
    files = []
    for i, doc in enumerate(synthetic_docs(12, seed=3)):
        files.append(str(root / f"doc{i}.txt"))
        Path(files[-1]).write_text(doc)
    return base, files


def config(folder: Path, corpus) -> Path:
    base, files = corpus
    cfg = {"model": {"base_model": base, "dtype": "float32"},
           "data": {"class_path": "kvgate.training.data.CPTDataModule",
                    "init_args": {"source": "files", "files": files, "seq_len": 32,
                                  "val_fraction": 0.0,
                                  "oracle": {"path": str(folder / "labels"), "chunk": 16,
                                             "shard_blocks": 2}}}}
    path = folder / "run.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict[str, str]:
    # one thread a process in both runs: the same kernels, so the same bits
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "TOKENIZERS_PARALLELISM": "false"}


def oracle(cfg: Path, devices: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvgate", "data", "oracle", "--config", str(cfg),
           "--devices", str(devices)]
    return subprocess.run(cmd, check=False, env=env(), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_two_processes_write_the_labels_of_one_bit_for_bit(tmp_path, corpus):
    one = oracle(config(tmp_path / "one", corpus), 1)
    assert one.returncode == 0, one.stderr[-2000:]
    two = oracle(config(tmp_path / "two", corpus), 2)
    assert two.returncode == 0, two.stderr[-2000:]
    a, b = LabelStore(tmp_path / "one" / "labels"), LabelStore(tmp_path / "two" / "labels")
    # one display, rank 0's, counting every rank's blocks from their progress files
    blocks = a.read().shape[0]
    shown = [line for line in two.stderr.splitlines() if line.startswith("oracle labels: ")]
    assert shown and shown[-1].startswith(f"oracle labels: {blocks}/{blocks} blocks (100%)")
    assert shown[-1].endswith("done; 2 processes")
    assert torch.equal(a.read(), b.read())
    assert a.manifest()["shards"] == b.manifest()["shards"]  # same files, sizes and hashes
    assert b.manifest()["done"] == a.read().shape[0] > 4
    assert not list(b.path.glob("progress-rank-*.json"))  # merged into one manifest


def test_a_killed_rank_and_a_rerun_continue_without_labelling_finished_shards(tmp_path, corpus):
    whole = oracle(config(tmp_path / "whole", corpus), 1)
    assert whole.returncode == 0, whole.stderr[-2000:]
    cfg = config(tmp_path / "killed", corpus)
    killer = tmp_path / "killer.py"
    killer.write_text(KILLER)
    mark = tmp_path / "rank1.dead"
    run = subprocess.Popen([sys.executable, str(killer), "data", "oracle", "--config", str(cfg),
                            "--devices", "2"], env={**env(), "KILL_MARK": str(mark)},
                           cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not mark.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert mark.exists(), "rank 1 never reached its second shard"
    time.sleep(1.0)  # rank 0 goes on with its shards, then waits for rank 1 at the end
    os.killpg(run.pid, signal.SIGKILL)  # the job is given up, as a scheduler would
    run.wait(30)
    store = LabelStore(tmp_path / "killed" / "labels")
    records = [r for f in store.path.glob("progress-rank-*.json")
               for r in json.loads(f.read_text())["shards"]]
    assert records and any(r["start"] // 2 % 2 == 1 for r in records)  # rank 1's first shard
    finished = {r["file"]: (store.path / r["file"]).stat().st_mtime_ns for r in records}
    again = oracle(cfg, 2)
    assert again.returncode == 0, again.stderr[-2000:]
    total = LabelStore(tmp_path / "whole" / "labels").manifest()["done"]
    assert f"{len(records) * 2} of {total} blocks were done; continuing" in again.stdout
    for name, mtime in finished.items():  # and the finished ones were not written again
        assert (store.path / name).stat().st_mtime_ns == mtime
    assert torch.equal(store.read(), LabelStore(tmp_path / "whole" / "labels").read())


def test_devices_below_one_are_one_line(tmp_path, corpus):
    bad = oracle(config(tmp_path / "bad", corpus), 0)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == ["error: --devices: must be an integer >= 1 (got 0)"]
    assert not (tmp_path / "bad" / "labels").exists()


def test_more_than_one_device_or_node_runs_ddp_and_one_does_not():
    from lightning.pytorch.strategies import DDPStrategy

    from kvgate.data.oracle.compute import labelling_trainer

    assert not isinstance(labelling_trainer("cpu", 1).strategy, DDPStrategy)
    assert isinstance(labelling_trainer("cpu", 2).strategy, DDPStrategy)
    assert isinstance(labelling_trainer("cpu", 1, num_nodes=2).strategy, DDPStrategy)
