// Anonymous memory from mmap for the KV store's regions and the candidate copies: address space only (pages
// are committed, zero-filled, on first write), 2 MiB aligned with a huge-page hint, released in the destructor;
// move-only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace ktq {

class MappedBuffer {
 public:
  MappedBuffer() = default;
  explicit MappedBuffer(size_t bytes);  // throws alloc_error (common/checked.h) naming the bytes when mmap fails
  ~MappedBuffer();
  MappedBuffer(MappedBuffer&& o) noexcept { swap(o); }
  MappedBuffer& operator=(MappedBuffer&& o) noexcept {
    swap(o);
    return *this;
  }
  MappedBuffer(const MappedBuffer&) = delete;
  MappedBuffer& operator=(const MappedBuffer&) = delete;
  uint8_t* data() const { return p_; }
  size_t size() const { return n_; }

 private:
  void swap(MappedBuffer& o) noexcept {
    std::swap(base_, o.base_), std::swap(mapped_, o.mapped_), std::swap(p_, o.p_), std::swap(n_, o.n_);
  }
  void* base_ = nullptr;
  size_t mapped_ = 0;
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace ktq
