"""bench/*.sh: the scripts behind docs/RESULTS.md parse, every step the usage line names
exists, and every config they name is in the tree (a removed config breaks a step only when
someone reruns it, long after the change)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.sh")) + sorted((ROOT / "scripts").glob("*.sh"))
RUN_RESULTS = (ROOT / "bench" / "run_results.sh").read_text()


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_every_step_in_the_usage_line_exists():
    usage = re.search(r'echo "usage: \$0 ([^"]+)"', RUN_RESULTS).group(1)
    steps = {part.split()[0] for part in usage.split("|")}
    labels = set(re.findall(r"^  ([a-z0-9]+)\)", RUN_RESULTS, flags=re.MULTILINE))
    assert steps == labels - {"all"}, steps ^ (labels - {"all"})


def test_every_config_named_by_run_results_exists():
    named = set(re.findall(r"configs/[\w/]+\.yaml", RUN_RESULTS))
    named |= {f"configs/{n}.yaml" for n in re.findall(r"--config ([a-z_0-9]+)\b", RUN_RESULTS)
              if n != "configs"}
    # the loops name their configs through a variable: expand `for x in a b c` over
    # `configs/ablation/$x.yaml` and `--config $x`
    for var, values in re.findall(r"for (\w+) in ([\w ]+);", RUN_RESULTS):
        for form, path in ((f"configs/ablation/${var}.yaml", "configs/ablation/{}.yaml"),
                           (f"--config ${var}\n", "configs/{}.yaml")):
            if form in RUN_RESULTS:
                named |= {path.format(v) for v in values.split()}
    # and the 256-token beta variants through their helper's VARIANT argument
    named |= {f"configs/ablation/recent64_256_{v}.yaml"
              for v in re.findall(r"^\s+ctx256_beta_gate (\w+) ", RUN_RESULTS, flags=re.MULTILINE)}
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert len(named) >= 25 and not missing, missing


@pytest.mark.parametrize(("args", "message"), [
    (["curve256", "c"], "curve256: PART must be a or b"),
    (["curve256b25"], "curve256b25: name at least one SEED"),
    (["no_such_step"], "usage: "),
])
def test_run_results_refuses_bad_arguments_before_running_anything(args, message):
    result = subprocess.run(["bash", str(ROOT / "bench" / "run_results.sh"), *args],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def _bench_kernel():
    from conftest import load_script

    return load_script("bench/bench_kernel.py")


def test_bench_kernel_refuses_the_flex_kernel_off_cuda_by_name():
    with pytest.raises(SystemExit, match="--flex: the FlexAttention kernel trains only on CUDA"):
        _bench_kernel().main(["--flex", "--shapes", "1,4,2,70,8"])


def test_bench_kernel_times_every_chunk_setting_against_the_materialised_kernel(capsys):
    results = _bench_kernel().main(["--shapes", "1,4,2,70,8", "--backward-rows", "0", "16",
                                    "--repeats", "1"])
    assert set(results["1,4,2,70,8"]) == {"materialised", "kvgate", "kvgate_bwd16"}
    assert "speed-up vs materialised" in capsys.readouterr().out


def test_bench_kernel_refuses_to_time_a_regime_that_computes_something_else():
    bench = _bench_kernel()
    fns = bench.regimes([0])
    fns["kvgate"] = lambda q, k, v, g: bench.gated_attention(q, k, v, g.detach(), recent=0)
    tensors = bench.inputs((1, 2, 1, 40, 8), torch.device("cpu"))
    with pytest.raises(SystemExit, match="kvgate disagrees"):
        bench.check(fns, tensors, torch.randn_like(tensors[0]))
