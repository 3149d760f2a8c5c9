"""The package's logger, `portable_kv`, and the lines it logs.

Its level comes from PORTABLE_KV_LOG_LEVEL (default WARNING), applied when this
module is imported (with the pools, or SGLang's glue) where the variable is set,
so that lines logged before any pool is built, SGLang's `install()` line among
them, follow it; else when the logger is first asked for.  Where the variable is set, a stderr handler is added once,
unless the logger has a handler of its own or the application's root handlers
already show records of that level: an engine that set up logging gets
portable_kv's records through its own handlers, once, and a script that did
not sees them on stderr.
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
    and where the variable is set give the logger a stderr handler once, where nothing shows its records."""
    global _configured
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel((config.LOG_LEVEL.raw() or "WARNING").upper())
    if config.LOG_LEVEL.given() and not logger.handlers and not _shown_by_root(logger.level):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    _configured = True
    return logger


def _shown_by_root(level: int) -> bool:
    """Whether a root handler emits records of `level`: a NullHandler, or one set to a higher
    level, leaves them unseen, and Python's last-resort handler shows only warnings."""
    return any(not isinstance(handler, logging.NullHandler) and handler.level <= level for handler in logging.getLogger().handlers)


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


if config.LOG_LEVEL.given() and config.LOG_LEVEL.problem() is None:
    configure()  # a malformed value is refused where it is read: at the first pool, or at check_all()
