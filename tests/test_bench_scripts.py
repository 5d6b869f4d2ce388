"""The scripts behind docs/RESULTS.md (bench/*.sh, experiments/run_results.sh) parse, every step
the usage line names exists, every config they name is in the tree (a removed config breaks a
step only when someone reruns it, long after the change), and every training of a variant
config writes to the folder named after it (the variant configs set no output folder)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.sh")) + sorted((ROOT / "scripts").glob("*.sh")) + \
    sorted((ROOT / "experiments").glob("*.sh"))
RUN_RESULTS_SH = ROOT / "experiments" / "run_results.sh"
RUN_RESULTS = RUN_RESULTS_SH.read_text()
VARIANTS = sorted((ROOT / "experiments" / "configs").glob("*.yaml"))


def commands(script: str) -> list[str]:
    """The script's lines with backslash continuations joined."""
    return script.replace("\\\n", " ").splitlines()


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
    # variants as `$C/NAME.yaml`, recipes as `--config NAME` (configs/NAME.yaml)
    named = {f"experiments/configs/{n}.yaml" for n in re.findall(r"\$C/(\w+)\.yaml", RUN_RESULTS)}
    named |= {f"configs/{n}.yaml" for n in re.findall(r"--config ([a-z_0-9/]+)\b", RUN_RESULTS)}
    # the loops name their configs through a variable: expand `for x in a b c` over `$C/$x.yaml`
    for var, values in re.findall(r"for (\w+) in ([\w ]+);", RUN_RESULTS):
        if f"$C/${var}.yaml" in RUN_RESULTS:
            named |= {f"experiments/configs/{v}.yaml" for v in values.split()}
    # and the 256-token beta variants through their helper's VARIANT argument
    named |= {f"experiments/configs/recent64_256_{v}.yaml"
              for v in re.findall(r"^\s+ctx256_beta_gate (\w+) ", RUN_RESULTS, flags=re.MULTILINE)}
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert len(named) >= 25 and not missing, missing


def test_variant_trainings_go_through_the_helpers_that_set_run_dir():
    """A variant config sets no output folder: a `kvgate train` of one without --run_dir would
    write into cpt_recipe's folders. Only the `variant` and `seed_run` helpers train them."""
    for line in commands(RUN_RESULTS):
        if re.match(r"\s*kvgate train ", line) and '"$@"' not in line:
            assert "$C" not in line and "${" not in line, line


def variant_layers(text: str, arrays: dict[str, str]) -> list[str]:
    """The experiments/configs stems that ``text`` layers, arrays (``"${NAME[@]}"``) expanded."""
    layers = []
    for token in text.split():
        used = re.fullmatch(r'"?\$\{(\w+)\[@\]\}"?', token)
        if used:
            layers += variant_layers(arrays[used.group(1)], arrays)
        layers += re.findall(r"\$C/(\$?\w+)\.yaml", token)
    return layers


def test_each_variant_writes_to_the_folder_named_after_its_last_config():
    arrays = dict(re.findall(r"^\s*(\w+)=\(([^)]*)\)", RUN_RESULTS, flags=re.MULTILINE))
    checked = 0
    for line in commands(RUN_RESULTS):
        match = re.match(r"\s*variant (\S+) (.*)", line)
        if match:
            name, rest = match.groups()
            layers = variant_layers(rest, arrays)
            assert layers and name == f"abl_{layers[-1]}", (name, layers)
            checked += 1
    assert checked >= 12


@pytest.mark.parametrize("path", VARIANTS, ids=[p.stem for p in VARIANTS])
def test_variant_headers_give_their_layers_and_run_dir(path):
    """Each variant's header command (what a reader copies) layers configs that exist and ends
    in its own --run_dir."""
    header = " ".join(line.lstrip("#").strip().rstrip("\\") for line in
                      path.read_text().splitlines() if line.startswith("#"))
    command = header.split("python train.py", 1)[1]
    layers = re.findall(r"--config (\S+)", command)
    # the recipe a variant starts from: cpt_recipe for the ablations, the main job's for the
    # levers of issue #65 (their run folders carry the file's own name)
    assert (ROOT / "configs" / f"{layers[0]}.yaml").is_file(), layers
    assert layers[-1] == f"experiments/configs/{path.name}"
    assert all((ROOT / layer).is_file() for layer in layers[1:]), layers
    assert re.search(rf"--run_dir runs/(abl_)?{path.stem}\b", command), command


@pytest.mark.parametrize(("args", "message"), [
    (["curve256", "c"], "curve256: PART must be a or b"),
    (["curve256b25"], "curve256b25: name at least one SEED"),
    (["no_such_step"], "usage: "),
])
def test_run_results_refuses_bad_arguments_before_running_anything(args, message):
    result = subprocess.run(["bash", str(RUN_RESULTS_SH), *args],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def _bench_kernel():
    from conftest import load_script

    return load_script("bench/bench_kernel.py")


def test_bench_kernel_times_every_chunk_setting_against_the_materialised_kernel(capsys):
    results = _bench_kernel().main(["--shapes", "1,4,2,70,8", "--backward-rows", "0", "16",
                                    "--repeats", "1"])
    assert set(results["1,4,2,70,8"]) == {"materialised", "kvgate", "kvgate_bwd16"}
    # each speed-up with the 95% interval of its paired repeats' median
    out = capsys.readouterr().out
    found = re.findall(r"speed-up vs materialised (\d+\.\d+)x \[(\d+\.\d+), (\d+\.\d+)\]", out)
    assert len(found) == 3 and all(float(lo) <= float(m) <= float(hi) for m, lo, hi in found), out


def test_bench_kernel_refuses_to_time_a_regime_that_computes_something_else():
    bench = _bench_kernel()
    fns = bench.regimes([0])
    fns["kvgate"] = lambda q, k, v, g: bench.gated_attention(q, k, v, g.detach(), recent=0)
    tensors = bench.inputs((1, 2, 1, 40, 8), torch.device("cpu"))
    with pytest.raises(SystemExit, match="kvgate disagrees"):
        bench.check(fns, tensors, torch.randn_like(tensors[0]))


def test_bench_decode_holds_the_kept_share_and_reports_every_regime(capsys, monkeypatch):
    from conftest import load_script

    from kvgate.policies import registry

    # the bench registers the research policy its gate regime ranks with: for this test only
    monkeypatch.setattr(registry, "POLICIES", dict(registry.POLICIES))
    bench = load_script("bench/bench_decode.py")
    bench.main(["--device", "cpu", "--layers", "2", "--prompt", "256", "--batch", "2",
                "--decode", "2", "--evict", "0.75"])
    out = capsys.readouterr().out
    held = [float(x) for x in re.findall(r"bytes (\d\.\d+)x", out)]
    # SnapKV, Ada-KV and the ranked gate at 75% eviction: a quarter of the dense cache's bytes (+ the
    # positions the ragged store keeps), each regime on its own model
    assert len(held) == 3 and all(0.25 <= h <= 0.28 for h in held), out
    assert all(f"batch   2 {name}" in out for name in ("dense", "snapkv", "adakv", "gate")), out
    ragged = {line.split()[2] for line in out.splitlines() if "(ragged heads)" in line}
    assert ragged == {"adakv"}, out  # Ada-KV splits the budget unevenly; the others do not


def test_bench_decode_graphed_regimes_run_the_fixed_shape_step(capsys, monkeypatch):
    """On the CPU the graphed regimes run the same fixed-shape step eagerly: the compressed
    one frozen (its bytes: the kept quarter plus the preallocated tail of 4 slots), the dense
    one on transformers' StaticCache; both compared with the dense graphed baseline too."""
    from conftest import load_script

    from kvgate.policies import registry

    monkeypatch.setattr(registry, "POLICIES", dict(registry.POLICIES))
    load_script("bench/bench_decode.py").main([
        "--device", "cpu", "--layers", "2", "--prompt", "256", "--batch", "2", "--decode", "2",
        "--evict", "0.75", "--regimes", "dense", "snapkv", "dense-graph", "snapkv-graph"])
    out = capsys.readouterr().out
    ratio = {name: float(x) for name, x in re.findall(
        r"batch   2 (\S+) .*\n(?:.*vs dense-graph.*\n)?.*vs dense: .*bytes (\d\.\d+)x", out)}
    assert ratio["snapkv-graph"] == pytest.approx((64 + 4) / 256, abs=0.01), out
    assert ratio["dense-graph"] == pytest.approx((256 + 4) / 256, abs=0.01), out
    assert out.count("vs dense-graph") == 1, out


def test_bench_decode_refuses_a_ratio_without_its_dense_baseline():
    from conftest import load_script

    with pytest.raises(SystemExit, match="'dense' first"):
        load_script("bench/bench_decode.py").main(["--regimes", "snapkv", "--device", "cpu"])


def test_bench_long_context_takes_policy_options_per_policy(capsys):
    """``--policy-opt NAME.KEY=VALUE`` parsed by ``kvgate eval``'s own ``parse_policies``: each
    option goes to its policy (values read as JSON, else kept as text); one naming no policy
    of the run, without NAME, or that the policy refuses, is one line before anything loads."""
    from conftest import load_script

    bench = load_script("bench/bench_long_context.py")
    args = bench.parse_args(["--policies", "snapkv,gate_rank", "--policy-opt",
                             "gate_rank.allocation=global", "--policy-opt", "snapkv.window=16"])
    assert args.policies == ["full", "snapkv", "gate_rank"]
    assert list(args.built) == args.policies
    assert args.built["gate_rank"].allocation == "global" and args.built["snapkv"].window == 16
    for bad, says in (("tova.window=16", "'tova' is not in --policies"),
                      ("window=16", "NAME.KEY=VALUE"), ("gate_rank.=1", "NAME.KEY=VALUE"),
                      ("gate_rank.allocation=nowhere", "--policy-opt")):
        with pytest.raises(SystemExit):
            bench.parse_args(["--policies", "gate_rank", "--policy-opt", bad])
        assert says in capsys.readouterr().err
