"""One ``APIRouter`` per resource: plans, profiles, probes, devices, health."""
