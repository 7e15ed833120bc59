/* Preloaded into the test processes (tests/conftest.py): XLA's CPU JIT registers the unwind tables of every
 * compiled program with libgcc_s (__register_frame). With jaxlib 0.12.0.1 on Debian 12's libgcc_s
 * (GCC 12.2) a long run of compiles and frees leaves a registered table whose memory is unmapped; the next
 * C++ exception anywhere in the process walks it and segfaults (seen: a read of an unmapped page inside
 * libgcc_s's FDE search). No exception ever unwinds through XLA's generated code, so not registering its
 * tables loses nothing. */
void __register_frame(void *begin) { (void)begin; }
void __deregister_frame(void *begin) { (void)begin; }
