"""The engine core in its own process (``process``) and its front end (``client``)."""

import gc


def freeze_heap() -> int:
    """Collect once, then move every object alive now into the permanent generation
    (``gc.freeze``, as vLLM's server processes do): a process that serves after a long start-up
    (modules, the model's Python objects) stops walking those objects in its full collections,
    which would otherwise pause a step (the engine core) or every stream's next chunk (the front
    end). Dev box, numpy backend and the server's modules: 66,514 tracked objects, a full
    collection 54-71 ms; after the freeze, 0.0 ms. Returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
