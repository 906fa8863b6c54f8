"""The codes of the cache, one package a codec behind one interface (:mod:`.base`), looked up by
name through :mod:`.registry` (which lists the packages; :mod:`.codebooks` is the default)."""
