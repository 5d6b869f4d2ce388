"""infer.py: one-line errors with exit code 2, and a full run on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from infer_fixtures import cli_fixture, tiny_base_fixture  # noqa: F401 - cli, tiny_base


@pytest.mark.parametrize("argv, message", [
    (["--policy", "nope"], "unknown policy 'nope'"),
    (["--budget", "1.5"], "budget ratio must lie in (0, 1]"),
    (["--budget", "0"], "budget ratio must lie in (0, 1]"),
    (["--policy", "snapkv", "--attn", "flash"], "needs attention scores"),
    (["--policy", "snapkv", "--policy-opt", "colour=red"], "no option 'colour'"),
    (["--policy-opt", "novalue"], "expected KEY=VALUE"),
    (["--decode-budget", "x"], "--decode-budget"),
    (["--policy", "h2o", "--cuda-graphs"], "evicts while decoding"),
])
def test_bad_arguments_exit_2_with_one_line(cli, tiny_base, capsys, argv, message):
    code = cli.main(["--model", "tiny", "--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert tiny_base == []  # refused before any model was loaded


def test_missing_checkpoint_and_prompt_file_exit_2(cli, capsys, tmp_path):
    assert cli.main(["--checkpoint", str(tmp_path / "none"), "--prompt", "hi"]) == 2
    assert "error: " in capsys.readouterr().err
    assert cli.main(["--model", "tiny", "--prompt-file", str(tmp_path / "p.txt")]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["mlp", "linear", "attention", None])
def test_a_checkpoints_gate_kind_picks_the_default_policy(cli, capsys, tmp_path, kind):
    """A local gate kind is served by local_gate, which evicts while decoding (so CUDA graphs
    are refused before anything loads); the attention kind, or an export from before kinds,
    by attention_gate."""
    from kvgate.checkpoint import CONFIG_NAME, FORMAT, FORMAT_VERSION

    folder = tmp_path / "gated"
    folder.mkdir()
    gate = {} if kind is None else {"kind": kind}
    (folder / CONFIG_NAME).write_text(json.dumps({
        "format": FORMAT, "format_version": FORMAT_VERSION, "base": {"id": str(tmp_path / "x")},
        "files": {}, "gate": gate}))
    assert cli.main(["--checkpoint", str(folder), "--prompt", "hi", "--cuda-graphs"]) == 2
    err = capsys.readouterr().err
    local = "policy 'local_gate' evicts while decoding" in err
    assert local == (kind in ("mlp", "linear")) and err.count("error: ") == 1


def test_generates_and_prints_stats(cli, tiny_base, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt here\n\nsecond\n")
    code = cli.main(["--model", "tiny", "--policy", "snapkv", "--budget", "0.5",
                     "--policy-opt", "window=4", "--prompt-file", str(prompts),
                     "--max-new-tokens", "5"])
    out = capsys.readouterr().out
    assert code == 0 and tiny_base == ["tiny"]
    assert "--- [1] second" in out and "KV bytes held" in out and "snapkv" in out
    code = cli.main(["--model", "tiny", "--policy", "h2o", "--budget", "6", "--prompt",
                     "json please", "--max-new-tokens", "3", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["stats"]["prompt_tokens"] == [11]
    assert data["stats"]["kept_fraction"] == pytest.approx(6 / 11)


def test_cuda_graphs_flag_decodes_the_same_tokens(cli, tiny_base, capsys):
    """``--cuda-graphs`` on the CPU runs the fixed-shape step eagerly: the same tokens."""
    argv = ["--model", "tiny", "--policy", "snapkv", "--budget", "0.5", "--policy-opt",
            "window=4", "--prompt", "a longer prompt for the cache", "--prompt", "short",
            "--max-new-tokens", "6", "--json"]
    assert cli.main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert cli.main([*argv, "--cuda-graphs"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == plain


def test_a_prompt_longer_than_the_model_is_refused_or_cut(cli, tiny_base, capsys):
    """Issue 36, case 2: the tiny model takes 256 positions; 300 characters + 4 new tokens do
    not fit. Refused in one line (exit 2), or cut from the start with --truncate, which says
    how much it dropped."""
    argv = ["--model", "tiny", "--prompt", "x" * 300, "--max-new-tokens", "4"]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "prompt 0 has 300 tokens + 4 new tokens; the model takes at most 256" in err
    assert "--truncate" in err
    code = cli.main([*argv, "--truncate", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "prompt 0 cut to its last 252 of 300 tokens (dropped 48 from the start)" in err
    assert json.loads(out)["stats"]["prompt_tokens"] == [252]


@pytest.mark.parametrize("device, message", [
    ("gpu", "device 'gpu' is not a device torch knows"),
    ("cuda:x", "device 'cuda:x' is not a device torch knows"),
    pytest.param("cuda", "device 'cuda': this torch is built without CUDA",
                 marks=pytest.mark.skipif(torch.cuda.is_available() or torch.version.cuda
                                          is not None, reason="a CUDA build of torch")),
])
def test_a_device_this_machine_lacks_is_one_line(cli, tiny_base, capsys, device, message):
    """Issue 36, case 8: --device cuda on a CPU-only torch ended in a 39-line traceback."""
    code = cli.main(["--model", "tiny", "--prompt", "hi", "--device", device])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {message}")
    assert err.count("\n") == 1 and tiny_base == []  # before any model was loaded


# ------------------------------------------------------------------------------- issue #46
@pytest.mark.parametrize("flag", ["--prompt-file", "--context-file"])
def test_a_user_file_that_is_not_utf8_is_one_line_naming_the_byte(cli, tiny_base, capsys,
                                                                  tmp_path, flag):
    """Issue #46 case 1: a Latin-1 file ended in a 20-line UnicodeDecodeError."""
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    extra = ["--question", "q?"] if flag == "--context-file" else []
    assert cli.main(["--model", "tiny", flag, str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {flag} {path}: not UTF-8 text (byte 0xe9 at offset 3); save it " \
                  "as UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8\n"
    assert tiny_base == []  # before any model was loaded


def test_cuda_graphs_off_cuda_say_so_and_give_the_same_statistics(cli, tiny_base, capsys):
    """Issue #46 case 3: with --cuda-graphs on the CPU, "KV bytes held" left out the decoded
    tokens (0.51x against 0.74x); now one line says the flag does nothing here."""
    argv = ["--model", "tiny", "--policy", "snapkv", "--budget", "0.5", "--policy-opt",
            "window=4", "--prompt", "a longer prompt for the cache", "--max-new-tokens", "6",
            "--json"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    plain = json.loads(out)["stats"]
    assert "cuda-graphs" not in err
    assert cli.main([*argv, "--cuda-graphs"]) == 0
    out, err = capsys.readouterr()
    graphed = json.loads(out)["stats"]
    assert err == ("warning: --cuda-graphs has no effect on the CPU (CUDA graphs need --device "
                   "cuda); decoding as without it\n")
    for key in ("bytes_held", "bytes_full", "kept_fraction", "new_tokens", "prompt_tokens"):
        assert graphed[key] == plain[key], key


def test_truncate_leaves_room_for_the_question_and_the_refusal_gives_a_length_that_fits(
        cli, tiny_base, capsys, tmp_path):
    """Issue #46 case 2: --truncate cut the context to the model's length less one token, then
    refused it because the question and the new tokens no longer fit; the refusal's advice
    ("keep its last N") could not fit either."""
    import re

    doc = tmp_path / "long.txt"
    doc.write_text("x" * 300)
    argv = ["--model", "tiny", "--context-file", str(doc), "--question", "what?",
            "--max-new-tokens", "4", "--no-chat", "--json"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    found = re.search(r"context 0 has ([\d,]+) tokens \+ (\d+) tokens for the question and its "
                      r"answer; the model takes at most 256 .* keep its last (\d+)", err)
    assert found and err.count("\n") == 1, err
    n, reserve, keep = (int(g.replace(",", "")) for g in found.groups())
    assert reserve > 4 and keep + reserve == 256
    assert cli.main([*argv, "--truncate"]) == 0
    out, err = capsys.readouterr()
    assert f"context 0 cut to its last {keep} of {n} tokens" in err
    assert json.loads(out)["stats"]["context_tokens"] == keep


def test_an_export_with_nan_gates_is_refused_in_one_line(cli, capsys, tmp_path):
    """#64: a diverged run's NaN gates loaded and evicted at random."""
    from training.kvtrain_fixtures import poison_gates, save_tiny_base

    from kvgate.training.export import export_module
    from kvgate.training.module import KVGateModule

    module = KVGateModule(base_model=save_tiny_base(tmp_path / "base"), train="gates",
                          image_every_n_steps=0)
    module.configure_model()
    out = export_module(module, tmp_path / "gated")
    key = poison_gates(out)
    assert cli.main(["--checkpoint", str(out), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"gates.safetensors: tensor '{key}' holds NaN values" in lines[0]
