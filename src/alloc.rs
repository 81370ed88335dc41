//! How the daemon asks the C allocator (glibc's malloc) to treat its memory. Batches for
//! gRPC messages are tens of MB; by default glibc maps each such buffer fresh from the kernel
//! and unmaps it when freed, so every batch costs a page fault per 4 KiB (4,700 for one batch
//! of 128 ImageNet-size samples) and an munmap: more of the daemon's time than copying the
//! samples. Kept in the heap instead, a freed buffer serves the next batch. Memory the daemon
//! frees stays with it until the heap's free top exceeds `TRIM_BYTES`, and is given back to
//! the machine at once when it runs short (`give_back`, after the memory tier has shrunk).

/// Allocations at least this large are mapped apart (and unmapped when freed).
const MMAP_BYTES: i32 = 64 << 20;
/// Free memory at the top of a heap beyond this goes back to the kernel.
const TRIM_BYTES: i32 = 256 << 20;

/// Sets the allocator up for the daemon (call once, early).
pub fn tune_for_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's parameters; called before the daemon's threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_BYTES);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_BYTES);
    }
}

/// Returns the memory the daemon has freed to the kernel (when the machine is short of it).
pub fn give_back() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim is thread-safe and only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
