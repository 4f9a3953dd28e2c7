"""Start a router over the replicas a stack's ``[engine]`` table asks for.

:func:`start_embedded_router`: ``replicas = N`` processes of the embedded engine (a
:class:`~loopstack.engine.seams.replica_pool.ReplicaPool` on the router's loop thread), their KV
events forwarded to the router's listeners. Blocks until every replica has loaded the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from loopstack.engine.llm_engine import EngineOptions
from loopstack.engine.loaders import load_tokenizer
from loopstack.engine.seams.replica_pool import ReplicaPool
from loopstack.inference.backends import EmbeddedBackend
from loopstack.inference.loop_thread import LoopThread
from loopstack.inference.router import Router, RouterOptions

__all__ = ["start_embedded_router"]

logger = logging.getLogger(__name__)


def start_embedded_router(
    model: str, num_replicas: int, options: EngineOptions, *, device: str = "cpu", dtype: str = "auto",
    quantization: str = "none", native_decode: bool = False, threads_per_replica: int | None = None,
    hooks_of: Callable[[], Any] = lambda: None, router_options: RouterOptions | None = None,
    start_timeout_s: float = 600.0,
) -> Router:
    """A started router over ``num_replicas`` embedded replicas of ``model``.

    Raises:
        ModelNotFoundError, ReplicaStartError: as :meth:`ReplicaPool.start` (nothing is left running).
    """
    tokenizer, _ = load_tokenizer(model)
    loop = LoopThread()
    pool = ReplicaPool(model, num_replicas, options, device=device, dtype=dtype, quantization=quantization,
                       native_decode=native_decode, threads_per_replica=threads_per_replica)
    try:
        loop.run(pool.start(timeout=start_timeout_s))
    except BaseException:
        loop.close()
        raise
    ready = pool.replicas
    router = Router(
        [EmbeddedBackend(pool, index) for index in range(num_replicas)], tokenizer=tokenizer,
        max_model_len=min(info.max_model_len or 0 for info in ready), block_size=options.block_size,
        loop=loop, hidden_state_model=pool.hidden_state_model, hooks_of=hooks_of,
        options=router_options or RouterOptions(),
        on_close=pool.close,
    )
    pool.subscribe_kv_events(router.deliver_kv_event)  # delivered on the router loop
    loop.run(router.started())
    for info in ready:
        logger.info("replica embedded-%d: pid %s, %s KV blocks, context %s", info.index, info.pid,
                    info.num_kv_blocks, info.max_model_len)
    return router
