"""``POST /v1/plan``: its schemas, the limit a plan starts from, a job of mixed cards, framework
configs, and the route."""
