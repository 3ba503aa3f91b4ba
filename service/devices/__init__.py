"""GPU inventory: NVML read off the event loop with a timeout (``gpus``), ``GET /v1/devices``
(``routes``)."""
