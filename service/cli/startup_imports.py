"""What the server leaves unimported at start, to be ready sooner.

Loading a transformers model imports ``transformers.modeling_utils``, which pulls in ``torch._dynamo``; that asks
whether Triton is installed by importing it, and Triton's import (its knobs, its compiled library) costs about a
second on a 2-core machine. Triton compiles GPU kernels only: on a machine where torch sees no CUDA device nothing
in the server can use it (torch's CPU compiler is C++, and xgrammar masks logits on the CPU with its own C++
kernel). There the server marks Triton as absent before anything imports it, and torch and xgrammar take their
no-Triton paths, which they have for machines without it. With a CUDA device, nothing changes.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)


def skip_triton_without_cuda() -> bool:
    """Mark Triton as not importable when torch sees no CUDA device and nothing has imported it yet; returns
    whether it did. ``LOADMASTER_KEEP_TRITON=1`` keeps it importable (e.g. for a process that compiles for a GPU
    it attaches later)."""
    if os.environ.get("LOADMASTER_KEEP_TRITON") == "1" or "triton" in sys.modules:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]  # import triton now raises ImportError
    log.debug("no CUDA device: Triton is left unimported (saves its import at start)")
    return True
