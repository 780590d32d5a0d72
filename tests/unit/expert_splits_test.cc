#include "worker/plan/expert_splits.h"

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace ltrain::worker {
namespace {

// Splits `rows` into chunks of `sizes` and concatenates them in `order`.
std::vector<int64_t> Reorder(const std::vector<int64_t>& rows, const std::vector<int64_t>& sizes,
                             const std::vector<int64_t>& order) {
  std::vector<int64_t> starts(sizes.size(), 0);
  for (size_t i = 1; i < sizes.size(); ++i) starts[i] = starts[i - 1] + sizes[i - 1];
  std::vector<int64_t> out;
  for (int64_t c : order) out.insert(out.end(), rows.begin() + starts[c], rows.begin() + starts[c] + sizes[c]);
  return out;
}

// Every rank of ep 1, 2 and 4 routes random rows (some experts none) to 8 experts; the exchange is
// played on host vectors of row ids: the all-to-all, the regroup, the experts (each row tagged with
// the expert that computed it), the ungroup and the all-to-all back. Every row must come home in its
// place, computed by the expert it was routed to.
TEST(ExpertSplitsTest, EveryRowReachesItsExpertAndComesBackInPlace) {
  constexpr int kExperts = 8;
  std::mt19937 rng(7);
  for (int ep : {1, 2, 4}) {
    const int local = kExperts / ep;
    // counts[s][e]: rows rank s routes to expert e; rank s's rows, sorted by expert, carry ids
    // s * 1000 + position and are routed to expert_of[s][position].
    std::vector<std::vector<int64_t>> counts(ep, std::vector<int64_t>(kExperts));
    std::vector<std::vector<int64_t>> rows(ep), expert_of(ep);
    for (int s = 0; s < ep; ++s) {
      for (int e = 0; e < kExperts; ++e) {
        counts[s][e] = (rng() % 4 == 0) ? 0 : rng() % 5;
        for (int64_t j = 0; j < counts[s][e]; ++j) {
          expert_of[s].push_back(e);
          rows[s].push_back(s * 1000 + static_cast<int64_t>(rows[s].size()));
        }
      }
    }
    std::vector<ExpertExchange> plans;
    for (int d = 0; d < ep; ++d) {
      std::vector<int64_t> received;
      for (int s = 0; s < ep; ++s) {
        for (int l = 0; l < local; ++l) received.push_back(counts[s][d * local + l]);
      }
      auto plan = PlanExpertExchange(counts[d], received, ep);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      plans.push_back(*plan);
    }
    // The all-to-all: rank d receives from each source s its send[d] rows, in source order.
    auto all_to_all = [&](const std::vector<std::vector<int64_t>>& in, bool back) {
      std::vector<std::vector<int64_t>> out(ep);
      std::vector<std::vector<int64_t>> offset(ep, std::vector<int64_t>(ep + 1, 0));
      for (int s = 0; s < ep; ++s) {
        const std::vector<int64_t>& sizes = back ? plans[s].recv : plans[s].send;
        for (int d = 0; d < ep; ++d) offset[s][d + 1] = offset[s][d] + sizes[d];
        EXPECT_EQ(offset[s][ep], static_cast<int64_t>(in[s].size()));
      }
      for (int d = 0; d < ep; ++d) {
        for (int s = 0; s < ep; ++s) {
          const int64_t want = back ? plans[d].send[s] : plans[d].recv[s];
          EXPECT_EQ(offset[s][d + 1] - offset[s][d], want) << "the counts of " << s << " and " << d << " disagree";
          out[d].insert(out[d].end(), in[s].begin() + offset[s][d], in[s].begin() + offset[s][d + 1]);
        }
      }
      return out;
    };
    std::vector<std::vector<int64_t>> got = all_to_all(rows, false);
    std::vector<std::vector<int64_t>> computed(ep);
    std::map<int64_t, int> computed_by;
    for (int d = 0; d < ep; ++d) {
      const ExpertExchange& p = plans[d];
      std::vector<int64_t> grouped = Reorder(got[d], p.received_chunks, p.regroup);
      int64_t at = 0;
      for (int l = 0; l < local; ++l) {
        for (int64_t j = 0; j < p.expert_rows[l]; ++j) computed_by[grouped[at + j]] = d * local + l;
        at += p.expert_rows[l];
      }
      EXPECT_EQ(at, static_cast<int64_t>(grouped.size()));
      computed[d] = Reorder(grouped, p.expert_chunks, p.ungroup);
    }
    std::vector<std::vector<int64_t>> home = all_to_all(computed, true);
    for (int s = 0; s < ep; ++s) {
      EXPECT_EQ(home[s], rows[s]) << "ep " << ep << " rank " << s;
      for (size_t i = 0; i < rows[s].size(); ++i) {
        EXPECT_EQ(computed_by[rows[s][i]], expert_of[s][i]) << "ep " << ep << " row " << rows[s][i];
      }
    }
  }
}

TEST(ExpertSplitsTest, RefusesWhatDoesNotSplit) {
  EXPECT_NE(PlanExpertExchange(std::vector<int64_t>(6, 1), std::vector<int64_t>(6, 1), 4).status().ToString().find(
                "6 experts do not split into 4"),
            std::string::npos);
  EXPECT_NE(PlanExpertExchange(std::vector<int64_t>(4, 1), std::vector<int64_t>(2, 1), 2).status().ToString().find(
                "brought 2 counts, not 4"),
            std::string::npos);
  EXPECT_FALSE(PlanExpertExchange({1, -1}, {1, 1}, 1).ok());
}

}  // namespace
}  // namespace ltrain::worker
