"""The allocator: block pool, prefix cache, per-type managers and coordinator.

``pymodel.PyAllocator`` is the plain-Python statement of ``SEMANTICS.md``
(the oracle); ``replay`` runs conformance traces through an allocator.
"""
