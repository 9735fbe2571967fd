"""``megatron-areal convert``: HF folder <-> Megatron distributed checkpoint.

    megatron-areal convert hf-to-mcore --hf HF_DIR --out CKPT_DIR [--tp N --pp N --ep N --etp N]
    megatron-areal convert mcore-to-hf --ckpt CKPT_DIR --out HF_DIR [--dtype bfloat16] [--adapter-only]

The checkpoint loads at any TP/PP(/EP) layout; ``--tp/--pp/--ep/--etp`` only choose the layout it
is written from (``--ep``/``--etp``: expert parallel and expert tensor parallel, MoE models).
``mcore-to-hf`` also accepts a training checkpoint directory; one of a ``model.lora`` run is written
merged into the base weights, or with ``--adapter-only`` as a PEFT adapter folder that
``peft.PeftModel.from_pretrained`` loads onto the base model.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

from megatron_areal.checkpoint.dist_ckpt import CheckpointMismatchError, CheckpointReadError
from megatron_areal.convert.convert import LayoutError, hf_to_mcore, mcore_to_hf
from megatron_areal.model.arch import UnsupportedModelError
from megatron_areal.model.hf_io import HFFormatError

log = logging.getLogger(__name__)

# Errors caused by the user's input: reported in one line, no traceback.
INPUT_ERRORS = (HFFormatError, CheckpointMismatchError, CheckpointReadError, UnsupportedModelError, FileNotFoundError,
                FileExistsError, LayoutError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-areal convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF folder -> Megatron distributed checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model folder (or a built-in model name)")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to create")
    to_mcore.add_argument("--tp", type=int, default=1)
    to_mcore.add_argument("--pp", type=int, default=1)
    to_mcore.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models)")
    to_mcore.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE models)")
    to_hf = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF folder")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint directory")
    to_hf.add_argument("--out", required=True, help="HF folder to create")
    to_hf.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="weight dtype (default: that of the HF model the checkpoint came from)")
    to_hf.add_argument("--adapter-only", action="store_true",
                       help="write only the low-rank adapters, as a PEFT folder (model.lora checkpoints)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    start = time.time()
    try:
        if args.direction == "hf-to-mcore":
            from megatron_areal.model.assets import resolve_model

            out = hf_to_mcore(resolve_model(args.hf), args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        else:
            out = mcore_to_hf(args.ckpt, args.out, dtype=getattr(torch, args.dtype) if args.dtype else None,
                              adapter_only=args.adapter_only)
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"direction": args.direction, "out": str(out), "seconds": round(time.time() - start, 2)}))
    return 0
