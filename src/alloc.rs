//! The daemon's allocator, and its memory as the kernel counts it.
//!
//! Rust's allocations go to jemalloc, not glibc's malloc. Batches for gRPC messages are tens of
//! MB, and each stream asks for its own sizes (batch sizes differ between jobs, last batches
//! are short, variable-length fields vary per batch). glibc either maps each such buffer
//! fresh from the kernel (a page fault per 4 KiB of every batch: more of the daemon's time
//! than copying the samples) or, with its mmap threshold raised, keeps the freed buffers of
//! every size in per-thread heaps that it does not give back: measured here, 150 MB beyond
//! what the daemon held under clients of many batch sizes. jemalloc reuses freed extents of
//! any size without faults and returns what stays unused for `dirty_decay_ms` to the kernel
//! from a background thread (README: memory, for the figures of both). C libraries (HDF5,
//! libjpeg-turbo) keep glibc's malloc; their allocations are small.

/// Rust's allocator for every binary that links larder.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main`: memory unused for about 100 ms goes back to the
/// kernel (madvise) from a background thread, started by `start_background_thread` once larderd
/// has forked its launcher and dropped its capabilities (a thread started before `main` would
/// keep them: capabilities belong to each thread), so the daemon holds little it does not
/// account for. Measured on the bytes path at 3x224x224 against the daemon before jemalloc: decay 0
/// 0.74x (a page fault per 4 KiB of every encoded batch again), 200-250 ms 0.98-0.99x, 1 s
/// 1.06x; against 250 ms, 100 ms is as fast (1.09x, rounds taking turns) and holds about 20
/// MiB less under the soak (`$_RJEM_MALLOC_CONF` overrides these, e.g. `dirty_decay_ms:250`).
/// Threads cache freed objects of up to 4 KiB only (jemalloc's default, 32 KiB, let each thread
/// park up to 200 freed samples of the memory tier per size class: under the soak the idle
/// daemon held 10 MiB more).
#[export_name = "_rjem_malloc_conf"]
#[allow(non_upper_case_globals)]
pub static malloc_conf: &[u8; 52] = b"dirty_decay_ms:100,muzzy_decay_ms:0,tcache_max:4096\0";

/// Starts jemalloc's background thread (see `malloc_conf`); false if it did not start.
pub fn start_background_thread() -> bool {
    let on = true;
    // SAFETY: a bool mallctl written from a bool; the name is NUL-ended.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            c"background_thread".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            (&on as *const bool).cast_mut().cast(),
            std::mem::size_of::<bool>(),
        ) == 0
    }
}

/// How often the daemon checks the pages the allocator holds freed, and gives them back when
/// they and the message path pass the path's share of the memory budget. The message path frees
/// tens of MB of encoded batches a second; jemalloc's decay alone kept a share of them that
/// followed the mix of streams (30-90 MiB under the soak, from one minute to the next). Before
/// this check, the daemon purged every 250 ms whatever it held: under the soak the same level
/// then held 25-80 MiB of freed pages between purges, beyond any share.
pub const PURGE_CHECK: std::time::Duration = std::time::Duration::from_millis(50);

/// Has glibc's malloc (the C libraries': HDF5, libjpeg-turbo) give the pages it holds freed
/// back to the kernel (under the soak about 10 MiB that it otherwise keeps for good).
pub fn trim_c_heap() {
    // SAFETY: malloc_trim takes a byte count to keep at the top of the heap and touches only
    // the allocator's free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The bytes an allocation of `len` bytes takes: jemalloc's size class for it.
pub fn allocation_size(len: usize) -> usize {
    if len == 0 {
        return 0;
    }
    // SAFETY: nallocx only computes a size class; it allocates nothing.
    match unsafe { tikv_jemalloc_sys::nallocx(len, 0) } {
        0 => len,
        n => n,
    }
}

/// Returns the memory the daemon has freed to the kernel now (when the machine is short of
/// it, or the daemon has gone idle), rather than after the decay time.
pub fn give_back() {
    // "arena.<MALLCTL_ARENAS_ALL>.purge": every arena's unused pages.
    let name = c"arena.4096.purge";
    // SAFETY: a mallctl that takes no argument and returns nothing; the name is NUL-ended.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            name.as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
}

/// Bytes of freed memory jemalloc holds for reuse (its dirty pages, all arenas), as of now.
pub fn free_bytes() -> u64 {
    let read = |name: &std::ffi::CStr| -> Option<usize> {
        let mut value: usize = 0;
        let mut len = std::mem::size_of::<usize>();
        // SAFETY: a read-only size_t mallctl into a size_t; the name is NUL-ended.
        let rc = unsafe {
            tikv_jemalloc_sys::mallctl(
                name.as_ptr(),
                (&mut value as *mut usize).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0).then_some(value)
    };
    // Statistics are a snapshot refreshed by writing "epoch".
    let mut epoch: u64 = 1;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: "epoch" reads and writes a uint64_t.
    unsafe {
        tikv_jemalloc_sys::mallctl(
            c"epoch".as_ptr(),
            (&mut epoch as *mut u64).cast(),
            &mut len,
            (&mut epoch as *mut u64).cast(),
            len,
        );
    }
    match (read(c"stats.arenas.4096.pdirty"), read(c"arenas.page")) {
        (Some(pages), Some(page)) => (pages * page) as u64,
        _ => 0,
    }
}

/// Anonymous memory the daemon may hold beyond what it accounts for (the memory tier, the
/// message buffers, the allocator's free pages): its code's heap, the async runtime and
/// threads' stacks, HTTP/2 buffers, datasets' indexes, HDF5's chunk caches, the allocator's
/// per-thread caches. Measured under benches/soak.py: about 40 MiB idle, 50-70 MiB median
/// under load, up to 112 MiB at peaks.
pub const UNACCOUNTED_ALLOWANCE: u64 = 128 << 20;

/// The daemon's memory as the kernel counts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Resident bytes (VmRSS).
    pub resident: u64,
    /// Resident anonymous bytes (RssAnon): the heap and stacks.
    pub anonymous: u64,
    /// Resident shared bytes (RssShmem): the rings' pages.
    pub shared: u64,
}

/// This process's footprint, from /proc/self/status (zeros where it cannot be read).
pub fn footprint() -> Footprint {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| parse_status(&s))
        .unwrap_or_default()
}

fn parse_status(status: &str) -> Footprint {
    let kib = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |k| k * 1024)
    };
    Footprint {
        resident: kib("VmRSS"),
        anonymous: kib("RssAnon"),
        shared: kib("RssShmem"),
    }
}

/// Below this, `prefault` leaves an allocation alone (it is likely reused memory, and a page or
/// two fault cheaply enough).
const PREFAULT_MIN: usize = 64 << 10;

/// Maps the pages of `v`'s allocation (up to its capacity) in one call, before they are
/// written: a large fresh allocation (a new record of the memory tier) otherwise takes a page
/// fault per 4 KiB as it is filled. A cold epoch of 500x375 JPEGs spent 10% of the daemon's
/// CPU in those faults; populated in one call, its CPU per image fell 8% (README: images).
/// Pages already mapped (reused memory) are only looked up. Kernels before 5.14 refuse the
/// call and the pages fault as before.
pub fn prefault(v: &mut Vec<u8>) {
    let (start, cap) = (v.as_mut_ptr() as usize, v.capacity());
    if cap < PREFAULT_MIN {
        return;
    }
    // SAFETY: sysconf only reads a constant of the system.
    let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as usize,
        _ => return,
    };
    let first = start.next_multiple_of(page);
    let end = (start + cap) / page * page;
    if end > first {
        // SAFETY: [first, end) lies within `v`'s allocation, which this call borrows
        // mutably; populating writes no byte, it only maps the pages (zeroed if new).
        unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                end - first,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefaulting_keeps_what_a_buffer_holds() {
        let mut v: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        v.reserve(1 << 20);
        prefault(&mut v);
        assert!(v.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        let mut fresh = Vec::with_capacity(1 << 20);
        prefault(&mut fresh);
        fresh.extend(std::iter::repeat_n(7u8, 1 << 20));
        assert!(fresh.iter().all(|&b| b == 7));
        prefault(&mut Vec::new());
    }

    #[test]
    fn reads_the_kernel_s_counts() {
        let s = "Name:\tlarderd\nVmRSS:\t  1000 kB\nRssAnon:\t   600 kB\nRssFile:\t 300 kB\nRssShmem:\t 100 kB\n";
        let f = parse_status(s);
        assert_eq!(
            (f.resident, f.anonymous, f.shared),
            (1000 << 10, 600 << 10, 100 << 10)
        );
        let me = footprint();
        assert!(me.resident > 0 && me.anonymous > 0 && me.anonymous <= me.resident);
    }

    #[test]
    fn freed_memory_is_seen_as_the_allocator_s_until_given_back() {
        // As in larderd, with the background thread (without it, jemalloc purges large frees
        // at once). Dirty until purged (after about 100 ms, or now); other tests' frees may
        // run the decay meanwhile: tried a few times.
        start_background_thread();
        let seen = (0..10).find_map(|_| {
            let big: Vec<u8> = vec![1; 32 << 20];
            assert_eq!(big.iter().map(|&b| b as usize).sum::<usize>(), 32 << 20);
            drop(big);
            let free = free_bytes();
            (free >= 16 << 20).then_some(free)
        });
        let free = seen.expect("32 MiB freed were never seen as the allocator's");
        // Other tests free memory meanwhile: purging brings the count down at some try.
        let purged = (0..20).any(|_| {
            give_back();
            free_bytes() < 16 << 20
        });
        assert!(purged, "{free} -> {}", free_bytes());
    }
}
