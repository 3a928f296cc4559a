#include "serve_sim.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <random>

#include "gpumem/errors.hpp"
#include <unistd.h>

#include "gpumem/kv/kv_cache.hpp"
#include "gpumem/kv/tier/host_store.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem::cli {

namespace {

using request = serve_request;

// The workload: the one given, else a function of the config (and its seed) alone.
std::vector<request> make_workload(const serve_sim_config& c) {
  if (!c.workload.empty()) return c.workload;
  std::mt19937_64 rng(c.seed);
  std::exponential_distribution<double> gap(c.arrival_rate);
  std::lognormal_distribution<double> prompt_len(std::log(c.prompt_median), c.prompt_sigma);
  std::lognormal_distribution<double> output_len(std::log(c.output_median), c.output_sigma);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<token_id> token(1, 128000);
  std::vector<std::vector<token_id>> systems(c.system_prompts);
  for (auto& s : systems) {
    s.resize(c.system_prompt_tokens);
    for (auto& t : s) t = token(rng);
  }
  std::vector<request> out(c.requests);
  double t = 0;
  // Arrivals at the peak rate, thinned to the rate of the moment (a non-homogeneous
  // Poisson process).
  auto rate_share = [&](double at) {
    if (c.load_period_seconds <= 0) return 1.0;
    return 0.1 + 0.9 * (0.5 - 0.5 * std::cos(2 * M_PI * at / c.load_period_seconds));
  };
  for (auto& r : out) {
    do t += gap(rng);
    while (unit(rng) > rate_share(t));
    r.arrival = t;
    r.output = std::clamp<std::size_t>(static_cast<std::size_t>(output_len(rng)), 1,
                                       c.max_model_len / 4);
    const std::size_t max_prompt = c.max_model_len - r.output;
    std::size_t user = std::clamp<std::size_t>(static_cast<std::size_t>(prompt_len(rng)), 4,
                                               c.max_model_len / 2);
    if (!systems.empty() && unit(rng) < c.shared_prefix_fraction)
      r.prompt = systems[rng() % systems.size()];
    user = std::min(user, max_prompt - std::min(max_prompt, r.prompt.size()));
    for (std::size_t i = 0; i < user; ++i) r.prompt.push_back(token(rng));
    if (c.max_samples >= 2 && unit(rng) < c.multi_sample_fraction)
      r.samples = 2 + rng() % (c.max_samples - 1);
  }
  return out;
}

// What a strategy does with memory; the serving loop is the same for each.
class kv_strategy {
 public:
  virtual ~kv_strategy() = default;
  // Admits request r (prompt in, n sequences); false when memory does not allow it now.
  virtual bool admit(std::size_t r, const request& req) = 0;
  // Could the request run to its end with the whole budget to itself?
  virtual bool fits(const request& req) const = 0;
  // One more token for every sequence of r; false when a block is missing.
  // `step` counts from 1; a sequence that already got step's token is skipped, so a retry
  // after a preemption appends only what is missing.
  virtual bool decode(std::size_t r, token_id t, std::size_t step) = 0;
  virtual void release(std::size_t r) = 0;
  virtual bool can_swap() const { return false; }
  virtual void swap_out(std::size_t) {}
  virtual bool try_swap_in(std::size_t) { return false; }
  virtual void after_step() {}
  // Slots allocated to sequences, slots holding tokens, KV bytes held.
  virtual void sample(std::size_t& allocated, std::size_t& filled, std::size_t& held) = 0;
  virtual void finish(serve_sim_result&) {}
};

class contiguous_strategy final : public kv_strategy {
 public:
  explicit contiguous_strategy(const serve_sim_config& c)
      : c_(c), per_instance_(c.budget_bytes / (c.max_model_len * c.layout.bytes_per_token())),
        slots_(per_instance_ * c.instances) {
    if (slots_ == 0)
      throw invalid_argument("serve-sim: the budget holds no max-length sequence");
  }
  bool admit(std::size_t r, const request& req) override {
    if (used_ + req.samples > slots_) return false;
    used_ += req.samples;
    tokens_[r] = {req.prompt.size(), req.samples};
    return true;
  }
  bool fits(const request& req) const override { return req.samples <= per_instance_; }
  bool decode(std::size_t r, token_id, std::size_t) override {
    tokens_[r].first += 1;
    return true;
  }
  void release(std::size_t r) override {
    used_ -= tokens_[r].second;
    tokens_.erase(r);
  }
  void sample(std::size_t& allocated, std::size_t& filled, std::size_t& held) override {
    allocated = used_ * c_.max_model_len;
    filled = 0;
    for (auto& [r, t] : tokens_) filled += t.first * t.second;
    held = slots_ * c_.max_model_len * c_.layout.bytes_per_token();
  }

 private:
  const serve_sim_config& c_;
  std::size_t per_instance_;
  std::size_t slots_;  // over every instance (requests are spread evenly)
  std::size_t used_ = 0;
  std::map<std::size_t, std::pair<std::size_t, std::size_t>> tokens_;  // tokens, samples
};

class paged_strategy final : public kv_strategy {
 public:
  paged_strategy(const serve_sim_config& c, platform& p, bool prefix, bool elastic,
                 std::uint64_t space)
      : c_(c), elastic_(elastic) {
    kv_cache_config k;
    k.layout = c.layout;
    k.max_blocks = c.budget_bytes / c.layout.block_stride();
    if (k.max_blocks == 0) throw invalid_argument("serve-sim: the budget holds no KV block");
    k.initial_blocks = elastic ? 0 : k.max_blocks;
    k.max_sequence_tokens = c.max_model_len;
    k.prefix_caching = prefix;
    watermark_ = std::max<std::size_t>(1, k.max_blocks / 100);
    max_blocks_ = k.max_blocks;
    const bool tiers = prefix && (c.host_tier_bytes != 0 || !c.kv_store_url.empty());
    for (std::size_t i = 0; i < c.instances; ++i) {
      auto n = std::make_unique<node>();
      pool_options o;
      o.limit_bytes = c.budget_bytes;
      n->pages = std::make_unique<vmm_page_pool>(p, 0, o);
      if (c.preempt_swap) n->host = std::make_unique<pinned_host_pool>(p, 0);
      if (tiers) {
        std::vector<std::unique_ptr<kv_store>> stores;
        if (c.host_tier_bytes != 0)
          stores.push_back(std::make_unique<host_store>(p, 0, c.host_tier_bytes));
        if (!c.kv_store_url.empty()) stores.push_back(make_redis_store(c.kv_store_url));
        kv_tiers_options to;
        to.space = space;
        to.write_through = c.tier_write_through;
        n->tiers = std::make_unique<kv_tiers>(p, 0, std::move(stores), to);
        k.tiers = n->tiers.get();
      }
      n->kv = std::make_unique<kv_cache>(*n->pages, k, n->host.get());
      nodes_.push_back(std::move(n));
    }
  }
  bool admit(std::size_t r, const request& req) override {
    // Keep a watermark free for running sequences' next tokens; add_sequence itself
    // refuses a prompt that does not fit (after its prefix hits).
    kv_cache& kv = cache(r);
    if (kv.available_blocks() < watermark_) return false;
    kv_cache::admission a;
    try {
      a = kv.add_sequence(req.prompt);
    } catch (const out_of_memory&) {
      return false;
    }
    prompt_tokens_ += req.prompt.size();
    cached_prompt_tokens_ += a.cached_tokens;
    auto& seqs = seqs_[r];
    seqs.push_back(a.id);
    for (std::size_t i = 1; i < req.samples; ++i) seqs.push_back(kv.fork(a.id));
    return true;
  }
  bool fits(const request& req) const override {
    // The shared prompt, then each sample's own output (and copy of the last prompt block).
    const std::size_t bt = c_.layout.block_tokens;
    const std::size_t worst = (req.prompt.size() + bt - 1) / bt +
                              req.samples * ((req.output + bt - 1) / bt + 1);
    return worst + watermark_ <= max_blocks_;
  }
  bool decode(std::size_t r, token_id t, std::size_t step) override {
    const token_id one[1] = {t};
    for (auto id : seqs_[r]) {
      std::size_t& last = last_step_[{r % nodes_.size(), id}];
      if (last == step) continue;
      try {
        cache(r).append(id, one);  // all or nothing
      } catch (const out_of_memory&) {
        return false;
      }
      last = step;
    }
    return true;
  }
  void release(std::size_t r) override {
    for (auto id : seqs_[r]) {
      cache(r).free(id);
      last_step_.erase({r % nodes_.size(), id});
    }
    seqs_.erase(r);
  }
  bool can_swap() const override { return c_.preempt_swap; }
  void swap_out(std::size_t r) override {
    for (auto id : seqs_[r]) cache(r).swap_out(id);
  }
  bool try_swap_in(std::size_t r) override {
    std::size_t need = 0;
    for (auto id : seqs_[r]) need += cache(r).blocks_needed(id, 0);
    if (cache(r).available_blocks() < need + watermark_) return false;
    for (auto id : seqs_[r]) cache(r).swap_in(id);
    return true;
  }
  void after_step() override {
    // Simulated steps run far faster than real ones: wait for the write-backs of each step,
    // as a real engine's worker keeps up with evictions (a few MB/s here), so tier hits do
    // not depend on the host's speed.
    for (auto& n : nodes_)
      if (n->tiers) n->tiers->flush();
    if (!elastic_) return;
    // Keep a little headroom mapped; give the rest back to the page pool.
    for (auto& n : nodes_) {
      const auto st = n->kv->stats();
      const std::size_t keep = std::max<std::size_t>(watermark_, st.used_blocks / 20);
      if (st.free_blocks > 2 * keep) n->kv->shrink(keep);
    }
  }
  void sample(std::size_t& allocated, std::size_t& filled, std::size_t& held) override {
    allocated = filled = held = 0;
    for (auto& n : nodes_) {
      const auto st = n->kv->stats();
      allocated += st.used_blocks * c_.layout.block_tokens;
      filled += st.filled_slots;
      held += st.mapped_bytes;
    }
  }
  void finish(serve_sim_result& r) override {
    std::uint64_t queries = 0, hits = 0;
    for (auto& n : nodes_) {
      if (n->tiers) n->tiers->flush();
      const auto st = n->kv->stats();
      queries += st.prefix_queries;
      hits += st.prefix_hits;
      r.block_ops += st.block_allocations + st.block_releases;
      r.tier_lookups += st.tier_lookups;
      r.recomputed_tokens_saved += st.tier_hits * c_.layout.block_tokens;
      if (auto why = n->kv->validate(); !why.empty())
        throw std::logic_error("serve-sim: KV cache invariant broken: " + why);
      if (!n->tiers) continue;
      const auto ts = n->tiers->stats();
      r.tiers.resize(ts.tiers.size());
      r.writebacks_dropped += ts.writebacks_dropped;
      for (std::size_t t = 0; t < ts.tiers.size(); ++t) {
        r.tiers[t].name = ts.tiers[t].name;
        r.tiers[t].hits += ts.tiers[t].hits;
        r.tiers[t].puts += ts.tiers[t].store.puts;
        r.tiers[t].errors += ts.tiers[t].store.errors;
        r.tiers[t].corrupt += ts.tiers[t].store.corrupt;
        r.tier_puts += ts.tiers[t].store.puts;
        r.tier_errors += ts.tiers[t].store.errors;
      }
    }
    r.prefix_hit_rate = queries == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(queries);
    r.prompt_tokens = prompt_tokens_;
    r.cached_prompt_tokens = cached_prompt_tokens_;
  }

 private:
  struct node {  // one serving instance (one GPU's cache); members die in reverse order
    std::unique_ptr<vmm_page_pool> pages;
    std::unique_ptr<pinned_host_pool> host;
    std::unique_ptr<kv_tiers> tiers;
    std::unique_ptr<kv_cache> kv;
  };
  kv_cache& cache(std::size_t r) const { return *nodes_[r % nodes_.size()]->kv; }

  const serve_sim_config& c_;
  bool elastic_;
  std::size_t watermark_ = 1, max_blocks_ = 0;
  std::vector<std::unique_ptr<node>> nodes_;
  std::map<std::size_t, std::vector<kv_cache::sequence_id>> seqs_;
  // Step of each sequence's last decode token, by (instance, sequence).
  std::map<std::pair<std::size_t, kv_cache::sequence_id>, std::size_t> last_step_;
  std::uint64_t prompt_tokens_ = 0, cached_prompt_tokens_ = 0;
};

}  // namespace

std::vector<std::string> serve_sim_strategies() {
  return {"contiguous", "paged", "paged_prefix", "elastic"};
}

bool serve_sim_uses_tiers(const std::string& strategy) {
  return strategy == "paged_prefix" || strategy == "elastic";
}

namespace {

std::unique_ptr<kv_strategy> make_strategy(const serve_sim_config& c, const std::string& strategy,
                                           platform& p) {
  // A key space of this run's own: no earlier run or other strategy hits its blocks.
  const std::uint64_t space =
      std::hash<std::string>{}(strategy) ^
      static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
      (static_cast<std::uint64_t>(::getpid()) << 40);
  std::unique_ptr<kv_strategy> s;
  if (strategy == "contiguous") s = std::make_unique<contiguous_strategy>(c);
  else if (strategy == "paged") s = std::make_unique<paged_strategy>(c, p, false, false, space);
  else if (strategy == "paged_prefix") s = std::make_unique<paged_strategy>(c, p, true, false, space);
  else if (strategy == "elastic") s = std::make_unique<paged_strategy>(c, p, true, true, space);
  else throw invalid_argument("serve-sim: unknown strategy '" + strategy + "'");
  return s;
}

// One strategy serving the workload, step by step: each step admits arrivals (swapped
// requests first), decodes one token per sequence (preempting the newest request when out
// of blocks), samples the memory, and lets finished requests leave.
class serving_run {
 public:
  serving_run(const serve_sim_config& c, kv_strategy& s, const std::vector<request>& work,
              serve_sim_result& res)
      : c_(c), s_(s), work_(work), res_(res), rng_(c.seed ^ 0x70c3) {}

  bool done() const { return res_.completed + res_.rejected >= work_.size(); }

  void step() {
    arrive(static_cast<double>(steps_) * c_.step_seconds);
    swap_back();
    admit();
    decode();
    sample();
    leave();
    s_.after_step();
    ++steps_;
    // A guard against a livelock of preemptions (a bug, not a workload property: requests
    // that cannot fit are rejected at admission). Steps with no request in the system (a
    // gap before the next arrival) are no livelock and do not count.
    if (running_.empty() && waiting_.empty() && swapped_.empty()) steps_since_completion_ = 0;
    else if (++steps_since_completion_ > 1000000)
      throw std::logic_error("serve-sim: no request completed in a million steps");
  }

  // The averages over the steps run.
  void finish(double host_seconds) {
    res_.host_seconds = host_seconds;
    s_.finish(res_);
    res_.sim_seconds = static_cast<double>(steps_) * c_.step_seconds;
    res_.waste_fraction = alloc_sum_ == 0 ? 0.0 : 1.0 - filled_sum_ / alloc_sum_;
    res_.mean_concurrent = concurrent_sum_ / static_cast<double>(steps_);
    res_.kv_bytes_mean = held_sum_ / static_cast<double>(steps_);
    res_.block_ops_per_second =
        res_.host_seconds > 0 ? static_cast<double>(res_.block_ops) / res_.host_seconds : 0.0;
  }

 private:
  struct active {
    std::size_t r;
    std::size_t generated = 0;
  };

  std::size_t sequences() const {
    std::size_t n = 0;
    for (auto& a : running_) n += work_[a.r].samples;
    return n;
  }

  void arrive(double now) {
    while (next_arrival_ < work_.size() && work_[next_arrival_].arrival <= now)
      waiting_.push_back(next_arrival_++);
  }

  // Swapped requests come back before new ones are admitted.
  void swap_back() {
    while (!swapped_.empty()) {
      if (s_.try_swap_in(swapped_.front().r)) {
        running_.push_back(swapped_.front());
        swapped_.pop_front();
      } else if (running_.empty()) {
        // It cannot come back even with nothing running (its forks no longer share blocks
        // once swapped): recompute it instead.
        s_.release(swapped_.front().r);
        waiting_.push_front(swapped_.front().r);
        swapped_.pop_front();
      } else {
        break;
      }
    }
  }

  void admit() {
    while (swapped_.empty() && !waiting_.empty()) {
      const std::size_t r = waiting_.front();
      if (!s_.fits(work_[r])) {  // could never finish, even alone: refuse it
        ++res_.rejected;
        waiting_.pop_front();
        continue;
      }
      if (!s_.admit(r, work_[r])) break;
      running_.push_back({r, 0});
      waiting_.pop_front();
    }
  }

  // Decode one token per sequence; out of blocks -> preempt the newest request.
  void decode() {
    for (std::size_t i = 0; i < running_.size();) {
      const token_id t = static_cast<token_id>(1 + rng_() % 128000);
      if (s_.decode(running_[i].r, t, steps_ + 1)) {
        ++i;
        continue;
      }
      active victim = running_.back();
      running_.pop_back();
      ++res_.preemptions;
      if (s_.can_swap()) {
        s_.swap_out(victim.r);
        swapped_.push_back(victim);
      } else {
        s_.release(victim.r);
        waiting_.push_front(victim.r);  // recomputed from its prompt later
      }
    }
  }

  void sample() {
    res_.max_concurrent = std::max(res_.max_concurrent, sequences());
    std::size_t allocated = 0, filled = 0, held = 0;
    s_.sample(allocated, filled, held);
    alloc_sum_ += static_cast<double>(allocated);
    filled_sum_ += static_cast<double>(filled);
    held_sum_ += static_cast<double>(held);
    concurrent_sum_ += static_cast<double>(sequences());
    res_.kv_bytes_peak = std::max(res_.kv_bytes_peak, held);
  }

  // Finished requests leave.
  void leave() {
    for (std::size_t i = 0; i < running_.size();) {
      if (++running_[i].generated < work_[running_[i].r].output) {
        ++i;
        continue;
      }
      s_.release(running_[i].r);
      ++res_.completed;
      steps_since_completion_ = 0;
      running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }

  const serve_sim_config& c_;
  kv_strategy& s_;
  const std::vector<request>& work_;
  serve_sim_result& res_;
  std::mt19937_64 rng_;
  std::deque<std::size_t> waiting_;
  std::vector<active> running_;  // in admission order
  std::deque<active> swapped_;   // preempted by swap, oldest first
  std::size_t next_arrival_ = 0;
  double alloc_sum_ = 0, filled_sum_ = 0, held_sum_ = 0, concurrent_sum_ = 0;
  std::size_t steps_ = 0, steps_since_completion_ = 0;
};

}  // namespace

serve_sim_result run_serve_sim(const serve_sim_config& c, const std::string& strategy,
                               platform& p) {
  if (auto why = c.layout.validate(); !why.empty()) throw invalid_argument("serve-sim: " + why);
  if ((c.workload.empty() && c.requests == 0) || c.arrival_rate <= 0 || c.step_seconds <= 0 ||
      c.max_model_len < 16 ||
      c.prompt_median < 1 || c.output_median < 1)
    throw invalid_argument("serve-sim: requests, rate, step time and lengths must be positive");
  if (c.instances == 0 || c.instances > 1024)
    throw invalid_argument("serve-sim: instances must be 1..1024");
  const std::unique_ptr<kv_strategy> s = make_strategy(c, strategy, p);
  const std::vector<request> work = make_workload(c);
  serve_sim_result res;
  res.strategy = strategy;
  serving_run run(c, *s, work, res);
  const auto t0 = std::chrono::steady_clock::now();
  while (!run.done()) run.step();
  run.finish(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return res;
}

}  // namespace gpumem::cli
