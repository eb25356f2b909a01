"""Device events awaited from the event loop without blocking it.

For code that records its own events around device work (a GPU-side snapshot before
staging, a custom transfer); astage's stagers use the same function.
"""

from ._staging.events import wait_event as wait_event

__all__ = ["wait_event"]
