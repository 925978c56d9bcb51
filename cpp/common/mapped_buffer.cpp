#include "common/mapped_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "common/checked.h"

namespace ktq {

// Address space only: pages are committed (zero-filled) on first write. Selected blocks are scattered over
// the whole context: with 2 MiB pages a tile costs no TLB miss of its own (a hint; without transparent huge
// pages it is a no-op).
MappedBuffer::MappedBuffer(size_t bytes) : n_(bytes) {
  if (bytes == 0) return;
  constexpr size_t kHuge = size_t(2) << 20;
  // room to start on a 2 MiB boundary
  const size_t want = bytes >= kHuge ? checked_add(bytes, kHuge, "a mapped buffer's bytes") : bytes;
  base_ = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base_ == MAP_FAILED) {
    const int err = errno;
    base_ = nullptr;
    throw alloc_error("could not reserve " + bytes_str(bytes) + " of address space (mmap: " + std::strerror(err) +
                      ")");
  }
  mapped_ = want;
  p_ = static_cast<uint8_t*>(base_);
  if (bytes >= kHuge) {
    p_ = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base_) + kHuge - 1) & ~(kHuge - 1));
    madvise(base_, mapped_, MADV_HUGEPAGE);
  }
}

MappedBuffer::~MappedBuffer() {
  if (base_) munmap(base_, mapped_);
}

}  // namespace ktq
