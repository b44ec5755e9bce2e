"""The engine core in its own process (``process``) and its front end (``client``)."""
