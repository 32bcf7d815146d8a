"""Random-weight models with a tokenizer beside them: a model config file alone (`.json`) gets
random weights and a stand-in tokenizer that decodes every token to "", which neither a grammar
nor streamed text can work with."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

# SmolLM2's vocabulary: the grammar benchmarks' random models take its tokenizer.
SMOLLM2_VOCAB_SIZE = 49152


def with_smollm2_tokenizer(config_path: Path, tokenizer_dir: Path, into: Path) -> Path:
    """`config_path`'s model with SmolLM2's vocabulary and special ids, written into `into`
    beside the tokenizer files of `tokenizer_dir`; returns the new config's path."""
    config = json.loads(config_path.read_text())
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}

    def special_id(name: str) -> int:
        token = tokenizer_config[name]
        return ids[token["content"] if isinstance(token, dict) else token]

    config.update(
        vocab_size=SMOLLM2_VOCAB_SIZE,
        bos_token_id=special_id("bos_token"),
        eos_token_id=[special_id("eos_token")],
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, into / name)
    path = into / "config.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def with_word_tokenizer(config: str) -> str:
    """A copy of a model config in a fresh folder beside a tokenizer.json of one word per token
    id ("t<id>"), so streamed text (and detokenization, on both sides) is real."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = json.loads(Path(config).read_text())["vocab_size"]
    folder = Path(tempfile.mkdtemp(prefix="loraplex-serving-"))
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    target = folder / Path(config).name
    target.write_text(Path(config).read_text())
    return str(target)
