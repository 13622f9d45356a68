"""Engine connectors of the cache layer. vLLM: `cachelayer.connectors.vllm.CacheLayerConnector`
(imported by vLLM itself through kv_connector_module_path; this package never imports vLLM)."""
