"""``POST /v1/admissions``: a scheduler's admission decision for a job (accept with a plan, size
its GPU count, or refuse an unreachable batch)."""
