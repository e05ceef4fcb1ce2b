"""`python -m pagedmoe.train {tokenizer,train,export,compare,eagle3}`."""

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

from pagedmoe.train.config import DEFAULT_CORPUS, ROUTERS, TrainConfig


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    for field in dataclasses.fields(TrainConfig):
        kind = float if field.default is None else type(field.default)
        choices = ROUTERS if field.name == "router" else None
        parser.add_argument("--" + field.name.replace("_", "-"), type=kind, default=None, choices=choices)


def given_fields(args: argparse.Namespace, config_cls) -> dict:
    """The dataclass fields set on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(config_cls) if getattr(args, f.name) is not None}


def config_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    given = given_fields(args, TrainConfig)
    return (base or TrainConfig()).replace(**given)


def cmd_tokenizer(args) -> None:
    from pagedmoe.train.tokenizer import build_tokenizer

    print(build_tokenizer(args.corpus, args.out_dir, args.vocab_size))


def cmd_train(args) -> None:
    from pagedmoe.train.trainer import CONFIG, train

    base = TrainConfig.load(Path(args.resume) / CONFIG) if args.resume else None
    print(train(config_from_args(args, base)))


def cmd_export(args) -> None:
    from pagedmoe.train.card import write_model_card
    from pagedmoe.train.export import export

    out = export(args.run_dir, args.out_dir, args.dtype, use_best=not args.last)
    if args.card_title:
        write_model_card(out, args.run_dir, args.command or shlex.join(["python", "-m", "pagedmoe.train", *sys.argv[1:]]), args.card_title)
    print(out)


def cmd_compare(args) -> None:
    from pagedmoe.train.compare import compare

    print(compare(config_from_args(args), Path(args.root), args.routers, args.plot and Path(args.plot)))


def cmd_eagle3(args) -> None:
    from pagedmoe.train.eagle_train import EagleConfig, train_eagle3

    print(train_eagle3(EagleConfig(**given_fields(args, EagleConfig))))


def add_eagle3_parser(sub) -> None:
    from pagedmoe.train.eagle_train import EagleConfig

    eagle = sub.add_parser("eagle3", help="train an EAGLE-3 draft head on a target model's hidden states")
    for field in dataclasses.fields(EagleConfig):
        parser_type = type(field.default)
        eagle.add_argument("--" + field.name.replace("_", "-"), type=parser_type, default=None)
    eagle.set_defaults(func=cmd_eagle3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pagedmoe.train", description="Train small MoE/dense models.")
    sub = parser.add_subparsers(dest="command_name", required=True)
    tok = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    tok.add_argument("--corpus", default=DEFAULT_CORPUS)
    tok.add_argument("--out-dir", required=True)
    tok.add_argument("--vocab-size", type=int, default=2048)
    tok.set_defaults(func=cmd_tokenizer)
    train = sub.add_parser("train", help="train (or resume) a model")
    train.add_argument("--resume", help="run dir whose saved config to reuse (flags override it)")
    add_config_flags(train)
    train.set_defaults(func=cmd_train)
    add_export_parser(sub)
    compare = sub.add_parser("compare", help="train every router variant and tabulate balance")
    compare.add_argument("--root", required=True)
    compare.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    compare.add_argument("--plot")
    add_config_flags(compare)
    compare.set_defaults(func=cmd_compare)
    add_eagle3_parser(sub)
    return parser


def add_export_parser(sub) -> None:
    export = sub.add_parser("export", help="export a run as an HF model dir")
    export.add_argument("run_dir")
    export.add_argument("out_dir")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    export.add_argument("--last", action="store_true", help="export the last step instead of the best validation step")
    export.add_argument("--card-title", help="also write README.md with this title and sample generations")
    export.add_argument("--command", help="training command to record in the model card")
    export.set_defaults(func=cmd_export)


def main(argv: list[str] | None = None) -> int:
    from pagedmoe.train.data import CorpusNotFoundError

    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except CorpusNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    return 0
