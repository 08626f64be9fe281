//! A host-side prefix store: cache snapshots keyed by the prompt they hold, under an LRU byte
//! budget. A new request restores the longest prefix it shares with a stored prompt and forwards
//! only the rest (seed §7).
//!
//! Rows of a snapshot depend only on the tokens before them (causal attention), so the first `k`
//! rows of a stored prompt are valid for any prompt that shares those `k` tokens.

use crate::CacheSnapshot;

/// Counters since start-up, and the store's current size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Lookups that restored at least one position.
    pub hits: u64,
    pub misses: u64,
    /// Positions restored instead of forwarded, summed over hits.
    pub reused_tokens: u64,
    /// Prompt positions looked up, summed over lookups.
    pub queried_tokens: u64,
    pub entries: usize,
    pub bytes: usize,
    pub budget: usize,
}

struct Entry {
    tokens: Vec<u32>,
    snapshot: CacheSnapshot,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixStore {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    stats: PrefixStats,
}

/// A prefix found for a prompt: restore `len` positions of `snapshot`.
pub struct PrefixHit<'a> {
    pub len: usize,
    pub snapshot: &'a CacheSnapshot,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixStore {
    /// A store that keeps at most `budget` bytes of snapshots; 0 disables it.
    pub fn new(budget: usize) -> PrefixStore {
        PrefixStore {
            budget,
            entries: Vec::new(),
            clock: 0,
            stats: PrefixStats {
                budget,
                ..PrefixStats::default()
            },
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// The longest stored prefix of `prompt`, at most `prompt.len() - 1` positions so that at least
    /// one token is forwarded (its logits start the generation). Counts a hit or a miss.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<PrefixHit<'_>> {
        if !self.enabled() || prompt.is_empty() {
            return None;
        }
        self.stats.queried_tokens += prompt.len() as u64;
        let cap = prompt.len() - 1;
        let best = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                (
                    i,
                    common_prefix(&e.tokens, prompt)
                        .min(e.snapshot.len)
                        .min(cap),
                )
            })
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)));
        let Some((i, len)) = best else {
            self.stats.misses += 1;
            return None;
        };
        self.clock += 1;
        self.stats.hits += 1;
        self.stats.reused_tokens += len as u64;
        let e = &mut self.entries[i];
        e.last_used = self.clock;
        Some(PrefixHit {
            len,
            snapshot: &e.snapshot,
        })
    }

    /// Whether a stored prompt already holds every position of `tokens` (storing it again would
    /// add nothing).
    pub fn covers(&self, tokens: &[u32]) -> bool {
        self.entries
            .iter()
            .any(|e| e.tokens.starts_with(tokens) && e.snapshot.len >= tokens.len())
    }

    /// Stores the snapshot of `tokens` (its `len` must be `tokens.len()`), evicting the least
    /// recently used entries to stay within the budget. Entries whose prompt is a prefix of
    /// `tokens` are replaced, since the new one serves every lookup they would. A snapshot larger
    /// than the whole budget is not stored.
    pub fn insert(&mut self, tokens: Vec<u32>, snapshot: CacheSnapshot) {
        let bytes = snapshot.bytes();
        if !self.enabled() || bytes > self.budget || snapshot.len < tokens.len() {
            return;
        }
        if self.covers(&tokens) {
            return;
        }
        self.entries.retain(|e| !tokens.starts_with(&e.tokens));
        while self.entries.iter().map(|e| e.bytes).sum::<usize>() + bytes > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            snapshot,
            bytes,
            last_used: self.clock,
        });
        self.stats.entries = self.entries.len();
        self.stats.bytes = self.entries.iter().map(|e| e.bytes).sum();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot of `len` positions at `row` bytes a position.
    fn snap(len: usize, row: usize) -> CacheSnapshot {
        CacheSnapshot {
            len,
            layers: vec![("k".to_string(), vec![7u8; len * row])],
        }
    }

    #[test]
    fn a_repeated_prompt_reuses_all_but_its_last_position() {
        let mut s = PrefixStore::new(1 << 20);
        assert!(s.lookup(&[1, 2, 3, 4]).is_none());
        s.insert(vec![1, 2, 3, 4], snap(4, 8));
        let hit = s.lookup(&[1, 2, 3, 4]).expect("a hit");
        assert_eq!(hit.len, 3);
        let st = s.stats();
        assert_eq!(
            (st.hits, st.misses, st.reused_tokens, st.entries),
            (1, 1, 3, 1)
        );
        assert_eq!(st.bytes, 32);
    }

    #[test]
    fn the_longest_shared_prefix_wins_and_a_disjoint_prompt_misses() {
        let mut s = PrefixStore::new(1 << 20);
        s.insert(vec![1, 2, 9, 9], snap(4, 1));
        s.insert(vec![1, 2, 3, 8, 8], snap(5, 1));
        assert_eq!(s.lookup(&[1, 2, 3, 4, 5]).map(|h| h.len), Some(3));
        assert!(s.lookup(&[5, 1, 2]).is_none());
        assert_eq!(s.stats().misses, 1);
    }

    #[test]
    fn the_least_recently_used_entry_is_evicted_under_the_budget() {
        let mut s = PrefixStore::new(100);
        s.insert(vec![1, 1, 1, 1], snap(4, 10)); // 40 bytes
        s.insert(vec![2, 2, 2, 2], snap(4, 10)); // 80
        assert!(s.lookup(&[1, 1, 1, 1, 5]).is_some()); // [1..] is now the most recent
        s.insert(vec![3, 3, 3, 3], snap(4, 10)); // would be 120: [2..] goes
        assert!(s.lookup(&[2, 2, 2, 2, 5]).is_none());
        assert!(s.lookup(&[1, 1, 1, 1, 5]).is_some());
        assert!(s.lookup(&[3, 3, 3, 3, 5]).is_some());
        assert_eq!(s.stats().entries, 2);
        assert!(s.stats().bytes <= 100);
    }

    #[test]
    fn an_extension_replaces_its_prefix_and_a_prefix_of_a_stored_prompt_is_not_stored() {
        let mut s = PrefixStore::new(1 << 20);
        s.insert(vec![1, 2], snap(2, 4));
        s.insert(vec![1, 2, 3], snap(3, 4));
        assert_eq!(s.stats().entries, 1);
        assert!(s.covers(&[1, 2]));
        s.insert(vec![1], snap(1, 4));
        assert_eq!(s.stats().entries, 1);
        assert_eq!(s.stats().bytes, 12);
    }

    #[test]
    fn a_zero_budget_stores_nothing_and_counts_nothing() {
        let mut s = PrefixStore::new(0);
        s.insert(vec![1, 2, 3], snap(3, 4));
        assert!(s.lookup(&[1, 2, 3]).is_none());
        assert_eq!(s.stats(), PrefixStats::default());
    }

    #[test]
    fn a_snapshot_larger_than_the_budget_is_refused() {
        let mut s = PrefixStore::new(10);
        s.insert(vec![1, 2, 3], snap(3, 4));
        assert_eq!(s.stats().entries, 0);
    }
}
