#include "gpumem/pool/core/overhead.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>
#include <vector>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

namespace {

constexpr std::size_t unit = 512;

using handle_ranges = std::vector<std::pair<std::uintptr_t, std::size_t>>;

// The multi-page handles a live or cached block touches a page of, in any segment: their
// free pages go back only with the block.
handle_ranges pinned_handles_of(const std::vector<memory_segment>& segments, std::size_t page,
                                handle_ranges handles) {
  if (page == 0 || handles.empty()) return {};
  std::sort(handles.begin(), handles.end());
  std::vector<bool> pinned(handles.size(), false);
  for (const memory_segment& seg : segments)
    for (const memory_block& b : seg.blocks) {
      if (b.st == memory_block::state::free) continue;
      const std::uintptr_t lo = b.address / page * page;
      const std::uintptr_t hi = (b.address + b.size + page - 1) / page * page;
      auto it = std::upper_bound(handles.begin(), handles.end(),
                                 std::pair{lo, static_cast<std::size_t>(-1)});
      if (it != handles.begin()) --it;
      for (; it != handles.end() && it->first < hi; ++it)
        if (it->first + it->second > lo) pinned[static_cast<std::size_t>(it - handles.begin())] = true;
    }
  handle_ranges out;
  for (std::size_t i = 0; i < handles.size(); ++i)
    if (pinned[i]) out.push_back(handles[i]);
  return out;
}

// Free bytes of one segment: {pinned, releasable}. With pages, a free byte is releasable
// when no live or cached block touches its page, nor any page of the multi-page handle it
// lies in (pinned_handles: a handle is given back whole); without, when none is in its
// segment.
std::pair<std::size_t, std::size_t> free_bytes_of(const memory_segment& seg, std::size_t page,
                                                  const handle_ranges& pinned_handles) {
  std::size_t free = 0;
  for (const memory_block& b : seg.blocks)
    if (b.st == memory_block::state::free) free += b.size;
  if (free == 0) return {0, 0};
  if (page == 0 || !seg.expandable) {
    const bool idle = std::all_of(seg.blocks.begin(), seg.blocks.end(), [](const memory_block& b) {
      return b.st == memory_block::state::free;
    });
    return idle ? std::pair{std::size_t{0}, free} : std::pair{free, std::size_t{0}};
  }
  // Pages of the segment a live or cached block touches (the segment starts on a page).
  const std::uintptr_t base = seg.address / page * page;
  std::vector<bool> touched((seg.address + seg.size - base + page - 1) / page, false);
  for (const memory_block& b : seg.blocks) {
    if (b.st == memory_block::state::free) continue;
    for (std::size_t p = (b.address - base) / page; p * page < b.address + b.size - base; ++p)
      touched[p] = true;
  }
  for (const auto& [at, bytes] : pinned_handles) {
    if (at + bytes <= base || at >= seg.address + seg.size) continue;
    const std::size_t first = at > base ? (at - base) / page : 0;
    const std::size_t end = std::min(touched.size(), (at + bytes - base + page - 1) / page);
    std::fill(touched.begin() + static_cast<std::ptrdiff_t>(first),
              touched.begin() + static_cast<std::ptrdiff_t>(end), true);
  }
  std::size_t releasable = 0;
  for (const memory_block& b : seg.blocks) {
    if (b.st != memory_block::state::free) continue;
    for (std::uintptr_t at = b.address; at < b.address + b.size;) {
      const std::size_t p = (at - base) / page;
      const std::uintptr_t page_end = base + (p + 1) * page;
      const std::uintptr_t end = std::min<std::uintptr_t>(page_end, b.address + b.size);
      if (!touched[p]) releasable += end - at;
      at = end;
    }
  }
  return {free - releasable, releasable};
}

std::string line(const std::string& indent, const char* what, std::size_t bytes,
                 std::size_t requested) {
  char buf[160];
  if (requested == 0)
    std::snprintf(buf, sizeof buf, "%s%-44s %12s\n", indent.c_str(), what, format_bytes(bytes).c_str());
  else
    std::snprintf(buf, sizeof buf, "%s%-44s %12s %8.3f%%\n", indent.c_str(), what,
                  format_bytes(bytes).c_str(), 100.0 * static_cast<double>(bytes) / static_cast<double>(requested));
  return buf;
}

}  // namespace

double overhead_breakdown::ratio() const noexcept {
  return requested == 0 ? 0.0 : static_cast<double>(reserved) / static_cast<double>(requested);
}

std::string overhead_breakdown::to_string(const std::string& indent) const {
  std::string out;
  char head[200];
  std::snprintf(head, sizeof head, "%s%s: %s reserved for %s requested (%.4f); %% of requested:\n",
                indent.c_str(), allocator.c_str(), format_bytes(reserved).c_str(),
                format_bytes(requested).c_str(), ratio());
  out += head;
  const std::string in = indent + "  ";
  out += line(in, "rounding to the 512-byte unit", unit_rounding, requested);
  out += line(in, page_size != 0 ? "rounding beyond it (whole pages, near fits)"
                                 : "rounding beyond it (near fits, split ends)",
              block_rounding, requested);
  for (const rounding_loss& l : largest_losses) {
    char what[120];
    std::snprintf(what, sizeof what, "  %zu x %s in %s blocks", l.count,
                  format_bytes(l.requested).c_str(), format_bytes(l.block).c_str());
    out += line(in, what, l.bytes(), requested);
  }
  out += line(in, "freed, held for reuse unmerged (caches)", cached, requested);
  out += line(in, page_size != 0 ? "free, in pages shared with live blocks"
                                 : "free, in segments holding live blocks",
              free_pinned, requested);
  out += line(in, page_size != 0 ? "free whole pages (trim could unmap them)"
                                 : "free whole segments (trim could free them)",
              free_releasable, requested);
  if (free_in_small_arena != 0) out += line(in, "  of the free bytes, in the small arena", free_in_small_arena, requested);
  if (page_size != 0) out += line(in, "physical pages kept unmapped for reuse", kept_unmapped, requested);
  if (other != 0) out += line(in, "other (retiring, lent or guarded pages)", other, requested);
  return out;
}

overhead_breakdown explain_overhead(const pool_base& pool) { return pool.overhead(); }

namespace detail {

overhead_breakdown breakdown_of(std::string allocator, std::size_t reserved,
                                std::size_t live_bytes, std::size_t page_size,
                                std::size_t kept_unmapped,
                                const std::vector<memory_segment>& segments,
                                const handle_ranges& multi_page_handles) {
  overhead_breakdown o;
  o.allocator = std::move(allocator);
  o.reserved = reserved;
  o.page_size = page_size;
  o.kept_unmapped = kept_unmapped;
  std::size_t in_segments = 0;
  std::map<std::pair<std::size_t, std::size_t>, std::size_t> shapes;  // (requested, block) -> count
  const handle_ranges pinned_handles = pinned_handles_of(segments, page_size, multi_page_handles);
  for (const memory_segment& seg : segments) {
    in_segments += seg.size;
    for (const memory_block& b : seg.blocks) {
      if (b.st == memory_block::state::cached) o.cached += b.size;
      if (b.st != memory_block::state::allocated) continue;
      const std::size_t in_units = (b.requested + unit - 1) / unit * unit;
      o.requested += b.requested;
      o.unit_rounding += std::min(in_units, b.size) - b.requested;
      o.block_rounding += b.size - std::min(in_units, b.size);
      if (b.size > in_units) shapes[{b.requested, b.size}] += 1;
    }
    const auto [pinned, releasable] = free_bytes_of(seg, o.page_size, pinned_handles);
    o.free_pinned += pinned;
    o.free_releasable += releasable;
    if (seg.small) o.free_in_small_arena += pinned + releasable;
  }
  // Guard-mode allocations are outside the segments: their requested bytes count as
  // requested, the rest of their pages as other.
  const std::size_t outside = live_bytes > o.requested ? live_bytes - o.requested : 0;
  o.requested += outside;
  const std::size_t accounted = in_segments + o.kept_unmapped + outside;
  o.other = o.reserved > accounted ? o.reserved - accounted : 0;
  for (const auto& [shape, count] : shapes) o.largest_losses.push_back({shape.first, shape.second, count});
  std::sort(o.largest_losses.begin(), o.largest_losses.end(),
            [](const rounding_loss& a, const rounding_loss& b) { return a.bytes() > b.bytes(); });
  if (o.largest_losses.size() > overhead_breakdown::max_losses)
    o.largest_losses.resize(overhead_breakdown::max_losses);
  return o;
}

}  // namespace detail
}  // namespace gpumem
