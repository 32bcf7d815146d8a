"""The adapters users train beyond plain LoRA, served end to end and compared with HF PEFT in
fp32: DoRA (alone, beside plain LoRA adapters and base rows in one batch, and on an AWQ base
against PEFT on the dequantized weights), LoRA on embed_tokens and lm_head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_lora_helpers import PeftReference
from lora_fixtures import registered_adapters
from safetensors.torch import save_file

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterValidationError
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow

NUM_TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS: dict[str, dict] = {
    "plain": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "dora": {"r": 8, "lora_alpha": 16, "target_modules": ALL, "use_dora": True},
    "dora-qv": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"],
                "use_dora": True, "use_rslora": True},
    # NOTE: large scalings: the tiny model's tied embeddings make it repeat its last token
    "lm-head": {"r": 8, "lora_alpha": 256, "target_modules": ["lm_head", "q_proj"]},
    "embed": {"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens", "v_proj"]},
    "embed-lm-head": {"r": 16, "lora_alpha": 256, "target_modules": ["embed_tokens", "lm_head"]},
}  # fmt: skip
PROMPTS = ["The capital of France is", "def quicksort(xs):", "Once upon a time", "Q: 2+2?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def peft(tiny_llama_dir, tmp_path_factory) -> PeftReference:
    return PeftReference(tiny_llama_dir, tmp_path_factory.mktemp("forms"), NUM_TOKENS, SPECS)


def _llm(model: Path, **kwargs) -> LLM:
    options = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_loras=4,
                   max_lora_rank=16, max_cpu_loras=8, async_scheduling=True)  # fmt: skip
    options.update(kwargs)
    return LLM(str(model), **options)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir)


def _generate(llm: LLM, peft: PeftReference, names: list[str | None], prompts: list[str]):
    requests = [None if n is None else LoRARequest(n, str(peft.paths[n])) for n in names]
    return llm.generate(prompts, GREEDY, lora_request=requests)


def test_dora_alone_equals_peft(llm, peft):
    out = _generate(llm, peft, ["dora"], PROMPTS[:1])[0]
    assert out.outputs[0].token_ids == peft.greedy("dora", out.prompt_token_ids)
    assert out.outputs[0].token_ids != peft.greedy(None, out.prompt_token_ids)


def test_dora_mixed_with_plain_lora_and_base_rows_equals_peft(llm, peft):
    names = [None, "plain", "dora", "dora-qv", "dora", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = _generate(llm, peft, names, prompts)
    for name, out in zip(names, outputs):
        assert out.outputs[0].token_ids == peft.greedy(name, out.prompt_token_ids), name


def test_vocabulary_lora_alone_equals_peft(llm, peft):
    out = _generate(llm, peft, ["embed-lm-head"], PROMPTS[1:2])[0]
    assert out.outputs[0].token_ids == peft.greedy("embed-lm-head", out.prompt_token_ids)
    assert out.outputs[0].token_ids != peft.greedy(None, out.prompt_token_ids)


def test_every_form_mixed_in_one_batch_equals_peft(llm, peft):
    """Seven rows, six adapters of four forms and a base row: more adapters than the four
    slots, so some wait for a slot and run in later steps beside others; each lm_head or
    embedding LoRA row changes the base model's text."""
    names = ["embed-lm-head", None, "lm-head", "dora", "embed", "plain", "lm-head"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outputs = _generate(llm, peft, names, prompts)
    for name, out in zip(names, outputs):
        assert out.outputs[0].token_ids == peft.greedy(name, out.prompt_token_ids), name
        if name in ("lm-head", "embed", "embed-lm-head"):
            assert out.outputs[0].token_ids != peft.greedy(None, out.prompt_token_ids), name


#: Small regime bounds, so that the tiny batches below meet all three kernel regimes. Wide
#: column tiles: the interpreter's cost is per program, and the lm_head's 49,152 columns in the
#: default 128- and 256-column tiles took most of these tests' minutes (tests/kernels/test_lora.py
#: crosses tile edges with tiny tiles).
SMALL_REGIMES = dict(decode_max_tokens=4, token_kernels_max_tokens=8, decode_block_n=2048,
                     expand_block_n=2048, group_block_n=2048)  # fmt: skip


def _cuda_path_on_cpu(llm: LLM, monkeypatch) -> set[str]:
    """Run `llm` as on CUDA, on the CPU: decode steps from graphs (their CPU stand-ins, with and
    without LoRA) and every LoRA hook through the Triton kernels, interpreted, one-token steps
    through the GEMV that carries the adapter ("fused"). Returns the set the kernel regimes met
    are added to."""
    from loraplex.kernels.gemv import GemvConfig
    from loraplex.kernels.lora import LoRAKernelConfig, check_lora_args, lora_triton
    from loraplex.kernels.lora.triton_gemv_lora import gemv_lora

    config = LoRAKernelConfig(**SMALL_REGIMES)
    regimes: set[str] = set()

    def triton_path(x, out, lora, meta, workspace, config_=None, counters=None):
        check_lora_args(x, out, lora, meta, workspace)
        regimes.add(config.regime(x.shape[0], counters is not None))
        lora_triton(x, out, lora, meta, workspace, config, counters)

    def fused_path(x, weight, bias, lora, meta, workspace, counter, config_=None):
        if x.shape[0] != 1:
            return None
        regimes.add("fused")
        return gemv_lora(x, weight, bias, lora, meta, workspace, counter, GemvConfig(16, 32, 4, 1))

    for module in ("lora_layer", "vocab_lora"):
        monkeypatch.setattr(f"loraplex.adapters.{module}.add_lora", triton_path)
    monkeypatch.setattr("loraplex.adapters.lora_layer.fused_gemv_lora", fused_path)
    runner = llm.engine.runner
    runner.graphs = runner.build_graph_runner()
    runner.graphs.capture()
    return regimes


def test_every_form_on_graphs_through_the_triton_kernels_equals_peft(
    tiny_llama_dir, peft, monkeypatch
):
    """The mixed batch of every form through the CUDA path's pieces (`_cuda_path_on_cpu`), in
    all three kernel regimes and the fused GEMV, under async scheduling: each token equals PEFT's."""
    # NOTE: plain weights, as on CUDA (an fp32 CPU engine holds them packed, and the fused GEMV
    # reads a plain one)
    monkeypatch.setattr("loraplex.quant.unquantized.pack", lambda weight: None)
    llm = _llm(tiny_llama_dir, max_num_seqs=8)
    regimes = _cuda_path_on_cpu(llm, monkeypatch)
    names = ["embed-lm-head", None, "lm-head", "dora", "embed", "plain", "dora-qv"]
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(len(names))]
    outputs = _generate(llm, peft, names, prompts)
    for name, out in zip(names, outputs):
        assert out.outputs[0].token_ids == peft.greedy(name, out.prompt_token_ids), name
    assert regimes == {"decode", "token", "group", "fused"}


def test_lm_head_lora_applies_to_prompt_logprobs(llm, peft):
    """Prompt logprobs come from the adapter's logits too (rows scored outside sampling)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    request = LoRARequest("lm-head", str(peft.paths["lm-head"]))
    out = llm.generate(PROMPTS[0], params, lora_request=request)[0]
    ids = out.prompt_token_ids
    peft.model.set_adapter("lm-head")
    with torch.no_grad():
        logits = peft.model(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    ours = [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], ids[1:])]
    torch.testing.assert_close(torch.tensor(ours), expected, rtol=1e-4, atol=1e-4)


def test_the_magnitude_changes_what_is_generated(llm, peft, tmp_path):
    """The same A and B without their magnitudes (served as plain LoRA) generate otherwise, so
    the equalities above check DoRA's scale, not only the LoRA delta."""
    from safetensors.torch import load_file

    folder = tmp_path / "no-magnitude"
    folder.mkdir()
    tensors = load_file(str(peft.paths["dora"] / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    config = json.loads((peft.paths["dora"] / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    dora = _generate(llm, peft, ["dora"], PROMPTS[1:2])[0].outputs[0].token_ids
    plain = llm.generate(PROMPTS[1], GREEDY, lora_request=LoRARequest("plain-ab", str(folder)))
    assert plain[0].outputs[0].token_ids != dora


#: Adapters with full module copies or trained token rows (PEFT wraps a module one way per
#: model, so each gets a PEFT model of its own), and plain / lm_head LoRA to mix with them.
SAVED_SPECS: dict[str, dict] = {
    "plain": SPECS["plain"],
    "lm-head": SPECS["lm-head"],
    "saved-lm-head": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                      "modules_to_save": ["lm_head"]},
    "saved-embed": {"r": 4, "lora_alpha": 8, "target_modules": ["v_proj"],
                    "modules_to_save": ["embed_tokens"]},
    "saved-both": {"r": 8, "lora_alpha": 16, "target_modules": ALL,
                   "modules_to_save": ["embed_tokens", "lm_head"]},
    "tokens": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]},  # + the prompts' ids
}  # fmt: skip
#: more adapters needing copies than copy slots (2 of the 4 LoRA slots), beside base rows
SAVED_BATCH = ["saved-lm-head", None, "saved-embed", "plain", "tokens", "saved-both",
               "lm-head", "saved-lm-head"]  # fmt: skip


class SavedReferences:
    """One `PeftReference` per adapter of `SAVED_SPECS`; `tokens` trains rows of some of the
    prompts' own token ids (tied to lm_head on the tied tiny model, as PEFT does)."""

    def __init__(self, model: Path, folder: Path, token_ids: list[int]) -> None:
        specs = dict(SAVED_SPECS)
        specs["tokens"] = {**specs["tokens"], "trainable_token_indices": token_ids}
        self.refs = {
            name: PeftReference(model, folder / name, NUM_TOKENS, {name: spec})
            for name, spec in specs.items()
        }
        self.paths = {name: ref.paths[name] for name, ref in self.refs.items()}

    def greedy(self, name: str | None, prompt_ids: list[int]) -> list[int]:
        return self.refs[name or "plain"].greedy(name, prompt_ids)

    def agrees(
        self, name: str | None, prompt_ids: list[int], tokens: list[int], tol: float
    ) -> bool:
        return self.refs[name or "plain"].agrees(name, prompt_ids, tokens, tol)


def _prompt_token_ids(model: Path, prompts: list) -> list[int]:
    """The distinct token ids of the prompts (ids themselves, or text through the tokenizer)
    but their last ones: with tied embeddings, a last token whose input and output rows both
    change still repeats itself."""
    if not isinstance(prompts[0], list):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        prompts = [tokenizer(p)["input_ids"] for p in prompts]
    last = {p[-1] for p in prompts}
    return sorted({i for p in prompts for i in p} - last)


#: the bf16 engine's greedy tokens against PEFT's fp32 logits: within this many standard
#: deviations of the best logit at each position (bf16 may flip near-ties, a wrong adapter
#: lands far off)
BF16_TOLERANCE = 0.25


def _check_rows(
    refs, names: list, outputs: list, tolerance: float | None, changed: set[str]
) -> None:
    """Each row's tokens are PEFT's greedy ones under its adapter (`tolerance` None: equal;
    else each within `tolerance` logit deviations of PEFT's best, see `PeftReference.agrees`)
    and, for the adapters in `changed`, not the base model's."""
    for name, out in zip(names, outputs):
        ids, got = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        if tolerance is None:
            assert got == refs.greedy(name, ids), name
            if name in changed:
                assert got != refs.greedy(None, ids), name
        else:
            assert refs.agrees(name, ids, got, tolerance), name
            if name in changed:
                assert not refs.agrees(None, ids, got, tolerance), name


def _serve_saved_batch(
    llm: LLM, refs: SavedReferences, prompts: list, tolerance: float | None = None
) -> None:
    """`SAVED_BATCH` in one call, checked by `_check_rows`."""
    names = SAVED_BATCH
    requests = [None if n is None else LoRARequest(n, str(refs.paths[n])) for n in names]
    rows = [prompts[i % len(prompts)] for i in range(len(names))]
    outputs = llm.generate(rows, GREEDY, lora_request=requests)
    _check_rows(refs, names, outputs, tolerance, set(SAVED_SPECS) - {"plain"})


def test_saved_modules_and_token_rows_mixed_in_one_batch_equal_peft(tiny_llama_dir, tmp_path):
    """modules_to_save copies of lm_head, embed_tokens or both, and trained token rows, each
    served to its own rows only, beside plain and lm_head LoRA and base rows; four adapters
    need the two copy slots, so they take turns."""
    refs = SavedReferences(tiny_llama_dir, tmp_path, _prompt_token_ids(tiny_llama_dir, PROMPTS))
    llm = _llm(tiny_llama_dir, max_saved_module_loras=2)
    _serve_saved_batch(llm, refs, PROMPTS)
    stats = llm.engine.lora_manager.stats()
    assert stats.gpu_evictions > 0  # the copy slots were reused


def test_saved_modules_are_refused_where_no_slot_holds_copies(llm, tiny_llama_dir, tmp_path):
    refs = SavedReferences(tiny_llama_dir, tmp_path, [5, 9])
    registered = registered_adapters(llm.engine.lora_manager)
    for name in ("saved-lm-head", "tokens"):
        request = LoRARequest(name, str(refs.paths[name]))
        with pytest.raises(AdapterValidationError, match="--max-saved-module-loras"):
            llm.generate(PROMPTS[0], GREEDY, lora_request=request)
    assert registered_adapters(llm.engine.lora_manager) == registered


def _dequantized_copy(llm: LLM, source: Path, folder: Path) -> Path:
    """A dense checkpoint of what the quantized model computes: every projection's dequantized
    weight, the rest copied from `source`."""
    from safetensors.torch import load_file

    folder.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    for module in llm.engine.runner.model.modules():
        shards = getattr(module, "shard_names", None)
        if shards is None or not hasattr(module, "method"):
            continue
        weight = module.method.dequantized_weight(module).float()  # [out, in]
        parent = module.prefix.rsplit(".", 1)[0]
        for name, lo, hi in zip(shards, module.shard_offsets(), module.shard_offsets()[1:]):
            tensors[f"{parent}.{name}.weight"] = weight[lo:hi].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    for path in source.iterdir():
        if path.name != "model.safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    return folder


@pytest.mark.parametrize("cuda_path", [False, True])
def test_dora_on_an_awq_base_equals_peft_on_the_dequantized_base(
    tiny_llama_dir, tmp_path, monkeypatch, cuda_path
):
    """DoRA rows beside base rows on an AWQ base; with `cuda_path` from graphs and through
    the Triton kernels (`_cuda_path_on_cpu`)."""
    from loraplex.quant.quantize import quantize_model

    awq_dir = quantize_model(tiny_llama_dir, tmp_path / "awq", progress=False, method="awq",
                             group_size=32)  # fmt: skip
    llm = _llm(awq_dir, max_num_seqs=4)
    if cuda_path:
        _cuda_path_on_cpu(llm, monkeypatch)
    dense_dir = _dequantized_copy(llm, tiny_llama_dir, tmp_path / "dequantized")
    specs = {"dora": {**SPECS["dora"], "lora_alpha": 64}}  # a strong delta: AWQ's text is flat
    peft = PeftReference(dense_dir, tmp_path / "adapters", NUM_TOKENS, specs)
    config = json.loads((peft.paths["dora"] / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    names = ["dora", None, "dora", "dora"]
    outputs = _generate(llm, peft, names, PROMPTS[:4])
    for name, out in zip(names, outputs):
        assert out.outputs[0].token_ids == peft.greedy(name, out.prompt_token_ids), name
    assert any(
        out.outputs[0].token_ids != peft.greedy(None, out.prompt_token_ids)
        for name, out in zip(names, outputs)
        if name
    )


#: a Llama config without a tokenizer (the GPU machine has no embedded model): prompts are ids
GPU_SOURCE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                     "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
                     "hidden_act": "silu", "torch_dtype": "float32"}  # fmt: skip


def _tokenizer_less_tiny(folder: Path) -> Path:
    source = folder / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(GPU_SOURCE_CONFIG))
    return write_tiny_llama(folder / "tiny", source)


def _serve_every_form(llm: LLM, tiny: Path, folder: Path, tolerance: float | None) -> None:
    """Every form of `SPECS` in one batch, then the module copies and token rows of
    `SAVED_SPECS` in another, checked by `_check_rows` (vocabulary adapters change the text)."""
    peft = PeftReference(tiny, folder / "adapters", NUM_TOKENS, SPECS)
    names = ["embed-lm-head", None, "lm-head", "dora", "embed", "plain", "dora-qv"]
    prompts = [[3 + 7 * i, 40 + i, 100 + 11 * i, 200 + i] for i in range(len(names))]
    requests = [None if n is None else LoRARequest(n, str(peft.paths[n])) for n in names]
    outputs = llm.generate(prompts, GREEDY, lora_request=requests)
    _check_rows(peft, names, outputs, tolerance, {"embed-lm-head", "lm-head", "embed"})
    refs = SavedReferences(tiny, folder / "saved", _prompt_token_ids(tiny, prompts[:4]))
    _serve_saved_batch(llm, refs, prompts[:4], tolerance)


def test_every_form_on_a_tokenizer_less_model_equals_peft(tmp_path):
    """The GPU test's model and batches on the CPU, eager, in fp32: every token equal."""
    tiny = _tokenizer_less_tiny(tmp_path)
    _serve_every_form(_llm(tiny, max_saved_module_loras=2), tiny, tmp_path, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_form_on_cuda_graphs_equals_peft(tmp_path):
    """The Triton kernels and CUDA-graph replay (decode) serve each form as PEFT does: the CUDA
    attention takes bf16 only, so the engine runs in bf16 and each of its greedy tokens is
    within `BF16_TOLERANCE` of PEFT's best fp32 logit (teacher-forced on the engine's tokens).
    A random tokenizer-less Llama: no model file to move to the device."""
    tiny = _tokenizer_less_tiny(tmp_path)
    # NOTE: max_num_seqs=16: five decode graphs to capture
    llm = _llm(tiny, device="cuda", dtype="bfloat16", enforce_eager=False,
               max_saved_module_loras=2, max_num_seqs=16)  # fmt: skip
    assert llm.engine.runner.graphs is not None
    _serve_every_form(llm, tiny, tmp_path, BF16_TOLERANCE)
