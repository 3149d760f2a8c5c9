"""The package's logger, `portable_kv`, and the lines it logs.

Its level comes from PORTABLE_KV_LOG_LEVEL (default WARNING), applied when the
logger is first asked for.  A handler is added only where the application has
configured none (neither on the root logger nor on this one): an engine that
set up logging gets portable_kv's records through its own handlers, and a
script that did not still sees them on stderr.
"""

from __future__ import annotations

import logging
from typing import Any

from . import config
from .layout import canonical_view

LOGGER_NAME = "portable_kv"
_configured = False


def configure() -> logging.Logger:
    """Apply PORTABLE_KV_LOG_LEVEL to the package logger (a malformed value raises ConfigError),
    and give it a stderr handler once, where the application configured none."""
    global _configured
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel((config.LOG_LEVEL.raw() or "WARNING").upper())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    _configured = True
    return logger


def package_logger() -> logging.Logger:
    """The `portable_kv` logger, configured from the setting the first time it is asked for."""
    return logging.getLogger(LOGGER_NAME) if _configured else configure()


def pool_line(pool: Any) -> str:
    """One line describing a host pool as built: geometry, layout and io, host memory and where it lives."""
    shapes = []
    for label, buffer in zip(pool.kind.labels, pool.buffers):
        view = canonical_view(buffer, pool.layout, pool.page_size)  # (page, token, layer, head, dim) whatever the layout
        shapes.append(f"{label} {view.shape[3]}x{view.shape[4]}")
    nbytes = sum(buffer.nbytes for buffer in pool.buffers)
    if pool.host_memory == "registered":
        memory = "registered (page-locked in place)"
    else:
        memory = "pinned (page-locked)" if pool.pin_memory else "pageable"
    node = pool.placement.node
    where = f"NUMA node {node}" if node is not None else "no NUMA node"
    return (f"{type(pool).__name__}: {pool.layer_num} layers, {', '.join(shapes)}, {pool.dtype}; "
            f"{pool.size} tokens in {pool.page_num} pages of {pool.page_size}; layout {pool.layout}, io {pool.io_backend}; "
            f"{nbytes / 2**20:.1f} MiB host memory, {memory}, {where} ({pool.placement.reason})")
