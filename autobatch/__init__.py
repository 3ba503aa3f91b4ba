"""autobatch: the largest micro-batch that fits, and the accumulation plan that reaches your batch."""

from __future__ import annotations
