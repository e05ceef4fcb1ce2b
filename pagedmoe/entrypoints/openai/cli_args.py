"""`pagedmoe serve` arguments. Imports nothing heavy, so building the CLI parser stays fast."""
import argparse
import os

from pagedmoe.entrypoints.cli import DEFAULT_MODEL, add_engine_args, engine_kwargs
from pagedmoe.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser):
    parser.add_argument("model", nargs="?", default=None, help="HF model directory (default: the bundled model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("PAGEDMOE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route except /health, /ping and "
                             "/version; open the dashboard as /dashboard?api_key=KEY (default: $PAGEDMOE_API_KEY)")
    parser.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: MODEL as given)")
    parser.add_argument("--max-waiting-requests", type=int, default=512,
                        help="requests the scheduler may hold unadmitted before answering 503")
    parser.add_argument("--max-request-body-bytes", type=int, default=4 << 20)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let tool_choice "auto" (the default with tools) extract calls with --tool-call-parser')
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how tool calls are written in the model's output (hermes also serves Qwen)")
    add_engine_args(parser)


def main(args: argparse.Namespace):
    from pagedmoe.entrypoints.openai.server import run_server
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagedmoe serve: --enable-auto-tool-choice needs --tool-call-parser")
    model = args.model or DEFAULT_MODEL
    if args.node_rank > 0:  # a further node of a several-node engine: its ranks, no server
        return run_headless(model, engine_kwargs(args))
    run_server(model, args.host, args.port, args.api_key,
               served_model_name=args.served_model_name or args.model or os.path.basename(DEFAULT_MODEL),
               max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_request_body_bytes,
               log_level=args.log_level, enable_auto_tool_choice=args.enable_auto_tool_choice,
               tool_call_parser=args.tool_call_parser, **engine_kwargs(args))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pagedmoe serve")
    add_serve_args(parser)
    main(parser.parse_args())


def run_headless(model: str, engine_args: dict):
    from pagedmoe.config import EngineConfig
    from pagedmoe.distributed.worker import run_node
    run_node(EngineConfig(model=model, **engine_args))
