"""An adapter that adds a token (its own tokenizer saved beside it, the token's row of a padded
base vocabulary trained with `trainable_token_indices`): its requests are encoded, rendered and
decoded with its tokenizer, base requests with the base's, greedy tokens equal PEFT's (fp32);
tokenizers that would change what base ids mean are refused and register nothing."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from engine_lora_helpers import PeftReference
from lora_fixtures import registered_adapters
from tokenizer_adapters import (
    NEW_TOKEN,
    PADDING,
    added_token_specs,
    padded_tiny_model,
    save_adapter_tokenizer,
)

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.adapters.errors import AdapterValidationError
from loraplex.adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, content_digest
from loraplex.grammar.errors import GrammarError
from loraplex.platform.core.structured_outputs import StructuredOutputs

pytestmark = pytest.mark.slow

NUM_TOKENS = 6
PROMPT = f"Please call {NEW_TOKEN} now"
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def padded(model_dir, tmp_path_factory) -> tuple[Path, int]:
    return padded_tiny_model(tmp_path_factory.mktemp("padded"), model_dir)


@pytest.fixture(scope="module")
def peft(padded, tmp_path_factory) -> PeftReference:
    tiny, new_id = padded
    ref = PeftReference(tiny, tmp_path_factory.mktemp("added"), NUM_TOKENS,
                        added_token_specs(new_id))  # fmt: skip
    assert save_adapter_tokenizer(tiny, ref.paths["added"]) == [new_id]
    return ref


@pytest.fixture(scope="module")
def llm(padded) -> LLM:
    return LLM(str(padded[0]), dtype="float32", device="cpu", num_kv_blocks=64, max_loras=2,
               max_lora_rank=8, max_cpu_loras=4, max_saved_module_loras=1)  # fmt: skip


def _request(peft: PeftReference) -> LoRARequest:
    return LoRARequest("added", str(peft.paths["added"]))


def test_prompts_are_encoded_with_the_adapters_tokenizer_and_run_as_peft(llm, peft, padded):
    from transformers import AutoTokenizer

    new_id = padded[1]
    adapter, base = llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[_request(peft), None])
    expected = AutoTokenizer.from_pretrained(str(peft.paths["added"]))(PROMPT)["input_ids"]
    assert adapter.prompt_token_ids == expected and new_id in expected
    assert base.prompt_token_ids == llm.tokenizer.encode(PROMPT)
    assert new_id not in base.prompt_token_ids  # the base tokenizer spells it out in pieces
    assert adapter.outputs[0].token_ids == peft.greedy("added", adapter.prompt_token_ids)
    assert base.outputs[0].token_ids == peft.greedy(None, base.prompt_token_ids)
    assert adapter.outputs[0].token_ids != peft.greedy(None, adapter.prompt_token_ids)


def test_the_new_token_is_decoded_for_the_adapter_only(llm, peft, padded):
    new_id = padded[1]
    forced = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=1,
                            logit_bias={new_id: 100.0})  # fmt: skip
    adapter, base = llm.generate(["Hi", "Hi"], forced, lora_request=[_request(peft), None])
    assert adapter.outputs[0].token_ids == [new_id, new_id]
    assert adapter.outputs[0].text == NEW_TOKEN * 2
    assert adapter.outputs[0].logprobs[0][new_id].decoded_token == NEW_TOKEN
    assert base.outputs[0].token_ids == [new_id, new_id]
    assert NEW_TOKEN not in base.outputs[0].text  # no such token in the base tokenizer
    stopped = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={new_id: 100.0},
                             stop=[NEW_TOKEN])  # fmt: skip
    (out,) = llm.generate("Hi", stopped, lora_request=_request(peft))
    assert (out.outputs[0].finish_reason, out.outputs[0].text) == ("stop", "")


def test_chat_uses_the_adapters_own_template_else_the_base_one(llm, peft, padded, tmp_path):
    new_id = padded[1]
    messages = [{"role": "user", "content": f"use {NEW_TOKEN}"}]
    (out,) = llm.chat(messages, GREEDY, lora_request=_request(peft))
    assert new_id in out.prompt_token_ids
    assert out.prompt_token_ids[:3] == llm.tokenizer.encode_chat(messages)[:3]  # base template
    own = tmp_path / "own-template"
    shutil.copytree(peft.paths["added"], own)
    (own / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((own / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (own / "tokenizer_config.json").write_text(json.dumps(config))
    (out,) = llm.chat(messages, GREEDY, lora_request=LoRARequest("own", str(own)))
    assert out.prompt == f"[use {NEW_TOKEN}]"
    assert new_id in out.prompt_token_ids


def test_structured_output_on_such_an_adapter_is_refused(llm, peft):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(choice=["a"]))
    with pytest.raises(GrammarError, match="own tokenizer"):
        llm.generate(PROMPT, params, lora_request=_request(peft))
    assert llm.generate("Hi", params)[0].outputs[0].text == "a"  # base requests keep grammars


def _bad_copy(peft: PeftReference, folder: Path, case: str) -> Path:
    """The adapter with a tokenizer broken as `case` says."""
    source = peft.paths["added"]
    shutil.copytree(source, folder)
    tiny = Path(peft.model.base_model.model.config._name_or_path)
    if case == "an id past the rows":
        (folder / "tokenizer.json").unlink()
        extra = [f"<|extra{i}|>" for i in range(PADDING + 1)]
        save_adapter_tokenizer(tiny, folder, *extra)
    elif case == "EOS remapped":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["eos_token"] = NEW_TOKEN
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    elif case == "a base id reassigned":
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        vocab = tokenizer["model"]["vocab"]
        vocab["call"], vocab["now"] = vocab["now"], vocab["call"]  # two base ids swapped
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    else:
        (folder / "tokenizer.json").write_text("{not json")
    return folder


BAD = {"an id past the rows": "embedding rows", "EOS remapped": "eos_token",
       "a base id reassigned": "keep every base id", "unreadable": "unreadable tokenizer"}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_a_tokenizer_that_changes_base_ids_is_refused(llm, peft, tmp_path, case):
    folder = _bad_copy(peft, tmp_path / "bad", case)
    registered = registered_adapters(llm.engine.lora_manager)
    with pytest.raises(AdapterValidationError, match=BAD[case]):
        llm.generate(PROMPT, GREEDY, lora_request=LoRARequest("bad", str(folder)))
    assert registered_adapters(llm.engine.lora_manager) == registered


def test_the_digest_covers_the_tokenizer(llm, peft, tmp_path):
    folder = peft.paths["added"]
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    digest = llm.engine.adapter_validator.validate(folder).digest
    assert digest != content_digest(config, weights)
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(folder / name, plain / name)
    assert llm.engine.adapter_validator.validate(plain).digest == content_digest(config, weights)
    assert content_digest(config, weights) == hashlib.sha256(config + weights).hexdigest()
