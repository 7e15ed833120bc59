"""The allocator: block pool, prefix cache, per-type managers and coordinator.

``pymodel.PyAllocator`` is the plain-Python statement of ``SEMANTICS.md``
(the oracle); ``replay`` runs conformance traces through it. The jitted pieces:
``pool`` (ref counts, LRU free queue), ``hashing`` (128-bit block hashes),
``prefix_cache`` (the hash table).
"""
