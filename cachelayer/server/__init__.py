"""The shared cache daemon (`cachelayer server`): a ZMQ data plane several engines share, plus HTTP
/healthcheck and /metrics. See docs/vllm.md."""

from cachelayer.server.client import StoreClient, StoreRefused, StoreUnavailable
from cachelayer.server.daemon import StoreServer
from cachelayer.server.protocol import KeySpace

__all__ = ["KeySpace", "StoreClient", "StoreRefused", "StoreServer", "StoreUnavailable"]
