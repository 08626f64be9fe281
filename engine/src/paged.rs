//! The block allocator of a paged KV cache, with prefix caching (after vLLM's block manager).
//!
//! The cache is a pool of `blocks` blocks of `block_size` token positions; a sequence's block
//! table lists, in order, the blocks that hold its positions. A block's refcount is the number of
//! tables that hold it. A full block can be registered under the chain key of its prefix,
//! `key(i) = hash(key(i - 1), tokens of block i)`, so a later prompt that starts with the same
//! tokens takes a reference instead of recomputing those positions. A registration keeps the
//! block's own tokens and a link to its parent's registration, and a lookup checks both, so a
//! hash collision costs a cache miss, never a wrong block.
//!
//! At refcount 0 an unregistered block goes to the free list, and a registered one to the tail
//! of an LRU list, where lookups still find it until an allocation that finds the free list empty
//! evicts the LRU head. Dropping a registration drops its descendants' too, since a child can
//! only be reached through its parent: every registered block stays reachable and accounted.
//! Each block is in exactly one place: the free list, the LRU, or held (refcount > 0).

use std::collections::HashMap;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

/// A misuse of the pool by its caller; the pool is unchanged by the call that returns one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolError {
    /// The block's refcount is already 0.
    NotHeld { block: u32 },
    /// The id names no block of this pool.
    OutOfRange { block: u32, blocks: usize },
    /// The block already has `u32::MAX` references.
    RefcountOverflow { block: u32 },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            PoolError::NotHeld { block } => {
                write!(f, "cache block {block} is not held by any sequence")
            }
            PoolError::OutOfRange { block, blocks } => {
                write!(
                    f,
                    "cache block {block} is outside the pool of {blocks} blocks"
                )
            }
            PoolError::RefcountOverflow { block } => {
                write!(f, "cache block {block} already has {} references", u32::MAX)
            }
        }
    }
}

impl std::error::Error for PoolError {}

/// Counters for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Calls to [`BlockPool::lookup_prefix`].
    pub queries: u64,
    /// Blocks that lookups returned.
    pub hit_blocks: u64,
    /// Whole blocks that lookups asked for.
    pub queried_blocks: u64,
    /// Registrations dropped to reuse a block: an evicted block's and its descendants'. Every
    /// registration ever made is either counted here or still in `cached_blocks`.
    pub evictions: u64,
    /// Registered blocks, referenced or not.
    pub cached_blocks: usize,
}

/// The chain key of a block from its parent's key (None for a table's first block) and its own
/// tokens. A field of the pool rather than a plain call so that tests can force collisions.
type ChainHash = fn(Option<u64>, &[u32]) -> u64;

fn chain_key(parent: Option<u64>, tokens: &[u32]) -> u64 {
    // `new()`, not `RandomState`: keys must agree across pools and runs for logs to compare.
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[derive(Debug, Default)]
struct Block {
    refs: u32,
    /// The key this block is registered under; None while it holds no cached prefix.
    key: Option<u64>,
    /// The tokens at this block's positions, while registered. Kept across registrations so a
    /// reused block does not reallocate.
    tokens: Vec<u32>,
    /// The registration this one extends. A block id is only reused after its registration
    /// and all its descendants' are dropped, so the id alone names the parent exactly.
    parent: Option<u32>,
    first_child: Option<u32>,
    prev_sibling: Option<u32>,
    next_sibling: Option<u32>,
    lru_prev: Option<u32>,
    lru_next: Option<u32>,
}

/// The blocks of a paged KV cache: who holds which, and which full blocks hold a known prefix.
pub struct BlockPool {
    block_size: usize,
    blocks: Vec<Block>,
    /// Popped from the back; a stack keeps recently freed (cache-warm) blocks in use.
    free: Vec<u32>,
    /// Registered blocks at refcount 0, least recently released first.
    lru_head: Option<u32>,
    lru_tail: Option<u32>,
    lru_len: usize,
    /// Blocks with refcount > 0.
    held: usize,
    index: HashMap<u64, u32>,
    hash: ChainHash,
    stats: PoolStats,
    /// The work list of `unregister`, kept to avoid an allocation per eviction.
    scratch: Vec<u32>,
}

impl fmt::Debug for BlockPool {
    // The per-block state of a large pool would drown a log line; the totals are what help.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BlockPool")
            .field("block_size", &self.block_size)
            .field("total", &self.total())
            .field("available", &self.available())
            .field("in_use", &self.in_use())
            .field("stats", &self.stats())
            .finish()
    }
}

impl BlockPool {
    /// A pool with every block free. A `block_size` of 0 is taken as 1, and `blocks` is capped
    /// at `u32::MAX` so every id fits a `u32`.
    pub fn new(blocks: usize, block_size: usize) -> BlockPool {
        BlockPool::with_hash(blocks, block_size, chain_key)
    }

    fn with_hash(blocks: usize, block_size: usize, hash: ChainHash) -> BlockPool {
        let blocks = blocks.min(u32::MAX as usize);
        BlockPool {
            block_size: block_size.max(1),
            blocks: (0..blocks).map(|_| Block::default()).collect(),
            // Reversed so that a fresh pool hands out 0, 1, 2, ... (readable logs and tests).
            free: (0..blocks as u32).rev().collect(),
            lru_head: None,
            lru_tail: None,
            lru_len: 0,
            held: 0,
            index: HashMap::new(),
            hash,
            stats: PoolStats::default(),
            scratch: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks an allocation can get now: free + evictable cached.
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn in_use(&self) -> usize {
        self.held
    }

    /// in_use / total (0.0 for an empty pool), for a gpu_cache_usage_perc gauge.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            self.held as f64 / self.blocks.len() as f64
        }
    }

    /// The block's refcount; 0 for an id outside the pool.
    pub fn refcount(&self, block: u32) -> u32 {
        self.blocks.get(block as usize).map_or(0, |b| b.refs)
    }

    /// One block with refcount 1, or None when nothing is available (the caller preempts).
    pub fn allocate(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.lru_head?;
                self.lru_remove(b);
                self.unregister(b);
                b
            }
        };
        self.blocks[b as usize].refs = 1;
        self.held += 1;
        Some(b)
    }

    /// `n` blocks or none at all (all-or-nothing; the pool is unchanged on None).
    pub fn allocate_n(&mut self, n: usize) -> Option<Vec<u32>> {
        // Checked up front, so a failure leaves nothing to roll back.
        if n > self.available() {
            return None;
        }
        // Each call succeeds: an eviction's cascade only moves blocks from the LRU to the free
        // list, so every allocate lowers `available` by exactly one.
        (0..n).map(|_| self.allocate()).collect()
    }

    /// Takes one more reference to a held block (a second sequence sharing it). A block at
    /// refcount 0 is refused even when cached: [`Self::lookup_prefix`] is the way to revive one,
    /// since only it checks that the block holds the caller's tokens.
    pub fn share(&mut self, block: u32) -> Result<(), PoolError> {
        let refs = self.block(block)?.refs;
        if refs == 0 {
            return Err(PoolError::NotHeld { block });
        }
        self.take_ref(block)
    }

    /// Drops one reference.
    pub fn release(&mut self, block: u32) -> Result<(), PoolError> {
        let blk = self.block_mut(block)?;
        if blk.refs == 0 {
            return Err(PoolError::NotHeld { block });
        }
        blk.refs -= 1;
        if blk.refs == 0 {
            let registered = blk.key.is_some();
            self.held -= 1;
            if registered {
                self.lru_push_back(block);
            } else {
                self.free.push(block);
            }
        }
        Ok(())
    }

    /// Releases every block of a table, in reverse order (so a sequence's tail blocks are
    /// evicted before its head blocks, which more prompts share). A bad entry does not stop the
    /// others from being released, so one corrupt id never leaks the rest of the table; the
    /// first error is returned.
    pub fn release_all(&mut self, table: &[u32]) -> Result<(), PoolError> {
        let mut first = Ok(());
        for &b in table.iter().rev() {
            if let Err(e) = self.release(b)
                && first.is_ok()
            {
                first = Err(e);
            }
        }
        first
    }

    /// The longest run of cached full blocks that hold `tokens`' leading full blocks, each now
    /// referenced by the caller (refcount +1; an evictable block leaves the LRU). Only whole
    /// blocks: at most tokens.len() / block_size of them. Counts stats.
    ///
    /// A caller that needs the logits of the last prompt token must leave it to compute: pass
    /// `&prompt[..prompt.len() - 1]`.
    pub fn lookup_prefix(&mut self, tokens: &[u32]) -> Vec<u32> {
        let mut hits = Vec::new();
        let mut parent: Option<(u64, u32)> = None;
        for chunk in tokens.chunks_exact(self.block_size) {
            let key = (self.hash)(parent.map(|p| p.0), chunk);
            let Some(&b) = self.index.get(&key) else {
                break;
            };
            if !self.holds(b, parent.map(|p| p.1), chunk) || self.take_ref(b).is_err() {
                break;
            }
            hits.push(b);
            parent = Some((key, b));
        }
        self.stats.queries += 1;
        self.stats.queried_blocks += (tokens.len() / self.block_size) as u64;
        self.stats.hit_blocks += hits.len() as u64;
        hits
    }

    /// Registers full block `table[i]` for every i < tokens.len() / block_size not yet
    /// registered, keyed by the chain hash of tokens[..(i+1)*block_size]; `table` is the
    /// sequence's table and `tokens` the tokens written at its positions. If another block
    /// already holds the same prefix, the existing registration is kept (no duplicate), and the
    /// blocks after it chain to it. Returns how many blocks it newly registered.
    ///
    /// Registration stops at the first block it cannot vouch for: past the end of `table`, an
    /// id outside the pool, a block nobody holds, a block registered for other tokens, or a
    /// hash collision with another prefix. A later block would then have no verifiable parent.
    pub fn register_prefix(&mut self, table: &[u32], tokens: &[u32]) -> usize {
        let mut registered = 0;
        let mut parent: Option<(u64, u32)> = None;
        for (&b, chunk) in table.iter().zip(tokens.chunks_exact(self.block_size)) {
            let key = (self.hash)(parent.map(|p| p.0), chunk);
            let parent_block = parent.map(|p| p.1);
            let Some(blk) = self.blocks.get(b as usize) else {
                break;
            };
            let holder = if blk.key.is_some() {
                // From a lookup or an earlier call: fine only if it holds this very prefix.
                if blk.key != Some(key) || !self.holds(b, parent_block, chunk) {
                    break;
                }
                b
            } else if let Some(&h) = self.index.get(&key) {
                if !self.holds(h, parent_block, chunk) {
                    break;
                }
                h
            } else {
                // A free block would be handed out again while findable by lookup.
                if blk.refs == 0 {
                    break;
                }
                self.register(b, key, parent_block, chunk);
                registered += 1;
                b
            };
            parent = Some((key, holder));
        }
        registered
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats {
            cached_blocks: self.index.len(),
            ..self.stats
        }
    }

    fn block(&self, block: u32) -> Result<&Block, PoolError> {
        let blocks = self.blocks.len();
        self.blocks
            .get(block as usize)
            .ok_or(PoolError::OutOfRange { block, blocks })
    }

    fn block_mut(&mut self, block: u32) -> Result<&mut Block, PoolError> {
        let blocks = self.blocks.len();
        self.blocks
            .get_mut(block as usize)
            .ok_or(PoolError::OutOfRange { block, blocks })
    }

    /// Whether registered block `b` extends `parent` with `tokens`: the check that makes a key
    /// match trustworthy.
    fn holds(&self, b: u32, parent: Option<u32>, tokens: &[u32]) -> bool {
        let blk = &self.blocks[b as usize];
        blk.parent == parent && blk.tokens == tokens
    }

    /// One more reference to an in-range block, held or cached.
    fn take_ref(&mut self, b: u32) -> Result<(), PoolError> {
        let blk = &mut self.blocks[b as usize];
        match blk.refs {
            u32::MAX => return Err(PoolError::RefcountOverflow { block: b }),
            0 => {
                // At refcount 0 an in-range block that `lookup_prefix` can find is in the LRU.
                blk.refs = 1;
                self.held += 1;
                self.lru_remove(b);
            }
            _ => blk.refs += 1,
        }
        Ok(())
    }

    fn register(&mut self, b: u32, key: u64, parent: Option<u32>, tokens: &[u32]) {
        let blk = &mut self.blocks[b as usize];
        blk.key = Some(key);
        blk.tokens.clear();
        blk.tokens.extend_from_slice(tokens);
        blk.parent = parent;
        self.index.insert(key, b);
        if let Some(p) = parent {
            let first = self.blocks[p as usize].first_child.replace(b);
            let blk = &mut self.blocks[b as usize];
            blk.prev_sibling = None;
            blk.next_sibling = first;
            if let Some(f) = first {
                self.blocks[f as usize].prev_sibling = Some(b);
            }
        }
    }

    /// Drops the registration of `root` (already out of the LRU) and of all its descendants.
    /// Descendants at refcount 0 move from the LRU to the free list, as nothing can find them
    /// any more; held ones stay held, unregistered.
    fn unregister(&mut self, root: u32) {
        self.unlink_from_parent(root);
        let mut stack = std::mem::take(&mut self.scratch);
        stack.push(root);
        while let Some(b) = stack.pop() {
            let mut child = self.blocks[b as usize].first_child.take();
            while let Some(c) = child {
                let c_blk = &mut self.blocks[c as usize];
                child = c_blk.next_sibling.take();
                c_blk.prev_sibling = None;
                stack.push(c);
            }
            let blk = &mut self.blocks[b as usize];
            blk.parent = None;
            if let Some(key) = blk.key.take() {
                self.index.remove(&key);
            }
            let orphan_cached = b != root && blk.refs == 0;
            self.stats.evictions += 1;
            if orphan_cached {
                self.lru_remove(b);
                self.free.push(b);
            }
        }
        self.scratch = stack;
    }

    fn unlink_from_parent(&mut self, b: u32) {
        let blk = &mut self.blocks[b as usize];
        let Some(parent) = blk.parent.take() else {
            return;
        };
        let (prev, next) = (blk.prev_sibling.take(), blk.next_sibling.take());
        match prev {
            Some(p) => self.blocks[p as usize].next_sibling = next,
            None => self.blocks[parent as usize].first_child = next,
        }
        if let Some(n) = next {
            self.blocks[n as usize].prev_sibling = prev;
        }
    }

    fn lru_push_back(&mut self, b: u32) {
        let tail = self.lru_tail;
        let blk = &mut self.blocks[b as usize];
        blk.lru_prev = tail;
        blk.lru_next = None;
        match tail {
            Some(t) => self.blocks[t as usize].lru_next = Some(b),
            None => self.lru_head = Some(b),
        }
        self.lru_tail = Some(b);
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, b: u32) {
        let blk = &mut self.blocks[b as usize];
        let (prev, next) = (blk.lru_prev.take(), blk.lru_next.take());
        match prev {
            Some(p) => self.blocks[p as usize].lru_next = next,
            None => self.lru_head = next,
        }
        match next {
            Some(n) => self.blocks[n as usize].lru_prev = prev,
            None => self.lru_tail = prev,
        }
        self.lru_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    impl BlockPool {
        /// Walks every structure and checks that each block is in exactly one place and that
        /// the index, the parent links and the counters agree.
        fn audit(&self) -> Result<(), String> {
            #[derive(Clone, Copy, Debug, PartialEq)]
            enum Place {
                Nowhere,
                Free,
                Lru,
                Held,
            }
            let n = self.blocks.len();
            let mut place = vec![Place::Nowhere; n];
            for &b in &self.free {
                let blk = &self.blocks[b as usize];
                if place[b as usize] != Place::Nowhere || blk.refs != 0 || blk.key.is_some() {
                    return Err(format!(
                        "free block {b}: {blk:?}, already {:?}",
                        place[b as usize]
                    ));
                }
                place[b as usize] = Place::Free;
            }
            let (mut cursor, mut prev, mut walked) = (self.lru_head, None, 0);
            while let Some(b) = cursor {
                let blk = &self.blocks[b as usize];
                if place[b as usize] != Place::Nowhere || blk.refs != 0 || blk.key.is_none() {
                    return Err(format!(
                        "LRU block {b}: {blk:?}, already {:?}",
                        place[b as usize]
                    ));
                }
                if blk.lru_prev != prev {
                    return Err(format!("LRU block {b} links back to {:?}", blk.lru_prev));
                }
                place[b as usize] = Place::Lru;
                walked += 1;
                (prev, cursor) = (cursor, blk.lru_next);
            }
            if prev != self.lru_tail || walked != self.lru_len {
                return Err(format!("LRU tail {:?}, {walked} walked", self.lru_tail));
            }
            let mut held = 0;
            for (b, blk) in self.blocks.iter().enumerate() {
                if blk.refs > 0 {
                    if place[b] != Place::Nowhere {
                        return Err(format!("held block {b} is also {:?}", place[b]));
                    }
                    place[b] = Place::Held;
                    held += 1;
                } else if place[b] == Place::Nowhere {
                    return Err(format!("block {b} is nowhere: {blk:?}"));
                }
                if place[b] != Place::Lru && (blk.lru_next.is_some() || blk.lru_prev.is_some()) {
                    return Err(format!("block {b} keeps stale LRU links"));
                }
            }
            if held != self.held {
                return Err(format!("{held} blocks held, counter says {}", self.held));
            }
            let mut registered = 0;
            for (b, blk) in self.blocks.iter().enumerate() {
                let b = b as u32;
                let Some(key) = blk.key else {
                    if blk.parent.is_some() || blk.first_child.is_some() {
                        return Err(format!("unregistered block {b} keeps links: {blk:?}"));
                    }
                    continue;
                };
                registered += 1;
                if self.index.get(&key) != Some(&b) || blk.tokens.len() != self.block_size {
                    return Err(format!("block {b} registered under {key} is not indexed"));
                }
                if let Some(p) = blk.parent {
                    if self.blocks[p as usize].key.is_none() {
                        return Err(format!("block {b} hangs from unregistered {p}"));
                    }
                    let mut siblings = self.blocks[p as usize].first_child;
                    let mut found = false;
                    while let Some(s) = siblings {
                        found |= s == b;
                        siblings = self.blocks[s as usize].next_sibling;
                    }
                    if !found {
                        return Err(format!(
                            "block {b} is missing from its parent {p}'s children"
                        ));
                    }
                }
                let mut child = blk.first_child;
                let mut prev = None;
                while let Some(c) = child {
                    let c_blk = &self.blocks[c as usize];
                    if c_blk.parent != Some(b) || c_blk.prev_sibling != prev {
                        return Err(format!("child {c} of {b} is mislinked: {c_blk:?}"));
                    }
                    prev = child;
                    child = c_blk.next_sibling;
                }
            }
            if registered != self.index.len() {
                return Err(format!(
                    "{registered} registered, {} indexed",
                    self.index.len()
                ));
            }
            Ok(())
        }
    }

    /// Keys collide all the time and ignore the parent, so only the stored tokens and parent
    /// links stand between a lookup and a wrong block.
    fn weak_hash(_parent: Option<u64>, tokens: &[u32]) -> u64 {
        tokens.iter().map(|&t| u64::from(t)).sum::<u64>() % 7
    }

    fn prompt(blocks: &[u32], block_size: usize) -> Vec<u32> {
        blocks
            .iter()
            .flat_map(|&t| std::iter::repeat_n(t, block_size))
            .collect()
    }

    /// Admits `tokens` the way a scheduler does: the cached prefix, then fresh blocks.
    fn admit(pool: &mut BlockPool, tokens: &[u32]) -> Vec<u32> {
        let mut table = pool.lookup_prefix(tokens);
        let need = tokens.len().div_ceil(pool.block_size()) - table.len();
        table.extend(pool.allocate_n(need).expect("the test pool has room"));
        pool.register_prefix(&table, tokens);
        table
    }

    #[derive(Clone, Debug)]
    enum Event {
        Admit {
            prompt: Vec<u32>,
            victim: usize,
        },
        Append {
            seq: usize,
            tokens: Vec<u32>,
            victim: usize,
        },
        Finish {
            seq: usize,
            register: bool,
        },
        Cancel {
            seq: usize,
        },
    }

    /// Prompts are made of a few fixed blocks so that prefixes repeat, plus a ragged tail.
    fn event() -> impl Strategy<Value = Event> {
        const TEMPLATES: [[u32; 4]; 3] = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 5]];
        let prompt = (vec(0..TEMPLATES.len(), 0..5), vec(0u32..3, 0..6)).prop_filter_map(
            "an empty prompt",
            |(blocks, tail)| {
                let mut p: Vec<u32> = blocks.iter().flat_map(|&i| TEMPLATES[i]).collect();
                p.extend(tail);
                (!p.is_empty()).then_some(p)
            },
        );
        prop_oneof![
            3 => (prompt, any::<usize>())
                .prop_map(|(prompt, victim)| Event::Admit { prompt, victim }),
            4 => (any::<usize>(), vec(0u32..3, 1..8), any::<usize>())
                .prop_map(|(seq, tokens, victim)| Event::Append { seq, tokens, victim }),
            1 => (any::<usize>(), any::<bool>())
                .prop_map(|(seq, register)| Event::Finish { seq, register }),
            1 => any::<usize>().prop_map(|seq| Event::Cancel { seq }),
        ]
    }

    struct Seq {
        table: Vec<u32>,
        tokens: Vec<u32>,
    }

    /// A scheduler over the pool, with a shadow of what each block's positions hold.
    struct Sim {
        pool: BlockPool,
        seqs: Vec<Seq>,
        /// Per block, the whole prefix through its last written position, as its writer saw it.
        written: Vec<Vec<u32>>,
    }

    impl Sim {
        fn new(pool: BlockPool) -> Sim {
            let written = vec![Vec::new(); pool.total()];
            Sim {
                pool,
                seqs: Vec::new(),
                written,
            }
        }

        /// Records a write of positions `from..` of `seq`; only an exclusive block may be written.
        fn write(&mut self, seq: &Seq, from: usize) -> Result<(), TestCaseError> {
            let bs = self.pool.block_size();
            for (i, &b) in seq.table.iter().enumerate().skip(from / bs) {
                prop_assert_eq!(self.pool.refcount(b), 1, "writing shared block {}", b);
                let end = seq.tokens.len().min((i + 1) * bs);
                self.written[b as usize] = seq.tokens[..end].to_vec();
            }
            Ok(())
        }

        fn preempt(&mut self, victim: usize) -> Result<bool, TestCaseError> {
            if self.seqs.is_empty() {
                return Ok(false);
            }
            let seq = self.seqs.swap_remove(victim % self.seqs.len());
            prop_assert_eq!(self.pool.release_all(&seq.table), Ok(()));
            Ok(true)
        }

        fn step(&mut self, event: &Event) -> Result<(), TestCaseError> {
            let bs = self.pool.block_size();
            match event {
                Event::Admit { prompt, victim } => {
                    let hit = self.pool.lookup_prefix(prompt);
                    prop_assert!(hit.len() <= prompt.len() / bs);
                    for (i, &b) in hit.iter().enumerate() {
                        prop_assert_eq!(&self.written[b as usize][..], &prompt[..(i + 1) * bs]);
                    }
                    let need = prompt.len().div_ceil(bs) - hit.len();
                    let before = self.pool.available();
                    let mut fresh = self.pool.allocate_n(need);
                    if fresh.is_none() {
                        prop_assert_eq!(self.pool.available(), before);
                        if self.preempt(*victim)? {
                            fresh = self.pool.allocate_n(need);
                        }
                    }
                    let Some(fresh) = fresh else {
                        prop_assert_eq!(self.pool.release_all(&hit), Ok(()));
                        return Ok(());
                    };
                    let seq = Seq {
                        table: hit.iter().chain(&fresh).copied().collect(),
                        tokens: prompt.clone(),
                    };
                    self.write(&seq, hit.len() * bs)?;
                    self.pool.register_prefix(&seq.table, &seq.tokens);
                    self.seqs.push(seq);
                }
                Event::Append {
                    seq,
                    tokens,
                    victim,
                } => {
                    if self.seqs.is_empty() {
                        return Ok(());
                    }
                    // Out of the list while it grows, so a preemption cannot pick it.
                    let mut s = self.seqs.swap_remove(seq % self.seqs.len());
                    for &t in tokens {
                        if s.tokens.len() == s.table.len() * bs {
                            let mut b = self.pool.allocate();
                            if b.is_none() && self.preempt(*victim)? {
                                b = self.pool.allocate();
                            }
                            let Some(b) = b else { break };
                            s.table.push(b);
                        }
                        s.tokens.push(t);
                        self.write(&s, s.tokens.len() - 1)?;
                        if s.tokens.len().is_multiple_of(bs) {
                            self.pool.register_prefix(&s.table, &s.tokens);
                        }
                    }
                    self.seqs.push(s);
                }
                Event::Finish { seq, register } => {
                    if self.seqs.is_empty() {
                        return Ok(());
                    }
                    let s = self.seqs.swap_remove(seq % self.seqs.len());
                    if *register {
                        self.pool.register_prefix(&s.table, &s.tokens);
                    }
                    prop_assert_eq!(self.pool.release_all(&s.table), Ok(()));
                }
                Event::Cancel { seq } => {
                    if !self.seqs.is_empty() {
                        let s = self.seqs.swap_remove(seq % self.seqs.len());
                        prop_assert_eq!(self.pool.release_all(&s.table), Ok(()));
                    }
                }
            }
            Ok(())
        }

        fn check(&self) -> Result<(), TestCaseError> {
            let pool = &self.pool;
            prop_assert_eq!(pool.in_use() + pool.available(), pool.total());
            let mut refs = vec![0u32; pool.total()];
            for s in &self.seqs {
                prop_assert_eq!(s.table.len(), s.tokens.len().div_ceil(pool.block_size()));
                for (i, &b) in s.table.iter().enumerate() {
                    refs[b as usize] += 1;
                    // Nobody overwrote a block this sequence still reads.
                    let end = s.tokens.len().min((i + 1) * pool.block_size());
                    prop_assert_eq!(&self.written[b as usize][..], &s.tokens[..end]);
                }
            }
            for (b, &r) in refs.iter().enumerate() {
                prop_assert_eq!(pool.refcount(b as u32), r, "block {}", b);
            }
            prop_assert_eq!(pool.in_use(), refs.iter().filter(|&&r| r > 0).count());
            if let Err(e) = pool.audit() {
                return Err(TestCaseError::fail(e));
            }
            Ok(())
        }
    }

    fn run_workload(pool: BlockPool, events: &[Event]) -> Result<(), TestCaseError> {
        let mut sim = Sim::new(pool);
        for event in events {
            sim.step(event)?;
            sim.check()?;
        }
        for s in std::mem::take(&mut sim.seqs) {
            prop_assert_eq!(sim.pool.release_all(&s.table), Ok(()));
        }
        sim.check()?;
        prop_assert_eq!(sim.pool.available(), sim.pool.total());
        prop_assert_eq!(sim.pool.in_use(), 0);
        let stats = sim.pool.stats();
        prop_assert!(stats.hit_blocks <= stats.queried_blocks);
        Ok(())
    }

    proptest! {
        #[test]
        fn a_random_workload_keeps_every_block_accounted_once(
            events in vec(event(), 1000)
        ) {
            run_workload(BlockPool::new(64, 4), &events)?;
        }

        #[test]
        fn colliding_keys_cost_hits_but_never_hand_out_wrong_blocks(
            events in vec(event(), 1000)
        ) {
            run_workload(BlockPool::with_hash(64, 4, weak_hash), &events)?;
        }
    }

    #[test]
    fn a_shared_prefix_block_is_freed_only_by_its_last_reader() {
        let mut pool = BlockPool::new(8, 4);
        let tokens = prompt(&[1, 2, 3], 4);
        let a = admit(&mut pool, &tokens);
        assert_eq!(pool.stats().cached_blocks, 3);
        let b = admit(&mut pool, &tokens);
        assert_eq!(a, b);
        assert!(a.iter().all(|&x| pool.refcount(x) == 2));

        pool.release_all(&a).unwrap();
        assert!(a.iter().all(|&x| pool.refcount(x) == 1));
        assert_eq!((pool.in_use(), pool.available()), (3, 5));

        pool.release_all(&b).unwrap();
        assert_eq!((pool.in_use(), pool.available()), (0, 8));
        assert_eq!(pool.stats().cached_blocks, 3);

        let c = pool.lookup_prefix(&tokens);
        assert_eq!(c, a);
        assert_eq!((pool.in_use(), pool.available()), (3, 5));
        pool.release_all(&c).unwrap();

        // The 5 free blocks go first; only then does the cache give way.
        let filler = pool.allocate_n(5).unwrap();
        let d = pool.lookup_prefix(&tokens);
        assert_eq!(d, a);
        pool.release_all(&d).unwrap();
        let more = pool.allocate_n(3).unwrap();
        assert!(pool.lookup_prefix(&tokens).is_empty());
        assert_eq!(pool.stats().evictions, 3);
        pool.release_all(&filler).unwrap();
        pool.release_all(&more).unwrap();
        assert_eq!(pool.available(), 8);
    }

    #[test]
    fn eviction_takes_a_released_table_tail_first() {
        let mut pool = BlockPool::new(4, 2);
        let tokens = prompt(&[1, 2, 3], 2);
        let table = admit(&mut pool, &tokens);
        pool.release_all(&table).unwrap();
        let spare = pool.allocate().unwrap();
        assert_eq!(
            pool.lookup_prefix(&tokens).len(),
            3,
            "the free block went first"
        );
        pool.release_all(&table).unwrap();

        assert_eq!(pool.allocate(), Some(table[2]));
        let head = pool.lookup_prefix(&tokens);
        assert_eq!(head, table[..2]);
        pool.release_all(&head).unwrap();
        assert_eq!(pool.allocate(), Some(table[1]));
        assert_eq!(pool.lookup_prefix(&tokens), table[..1]);
        assert_eq!(pool.release(spare), Ok(()));
    }

    #[test]
    fn a_lookup_revives_an_evictable_block_and_moves_it_to_the_lru_tail() {
        let mut pool = BlockPool::new(2, 1);
        let a = admit(&mut pool, &[7]);
        let b = admit(&mut pool, &[8]);
        pool.release_all(&a).unwrap();
        pool.release_all(&b).unwrap();
        // 7 was released first, but this lookup makes it the most recently released.
        let again = pool.lookup_prefix(&[7]);
        pool.release_all(&again).unwrap();
        assert_eq!(pool.allocate(), Some(b[0]));
        assert_eq!(pool.lookup_prefix(&[7]), a);
    }

    #[test]
    fn the_parent_chain_keeps_a_lookup_off_another_prefixs_later_block() {
        let mut pool = BlockPool::new(8, 4);
        let a_tokens = prompt(&[1, 2], 4);
        let a = admit(&mut pool, &a_tokens);
        let b_tokens = prompt(&[9, 2], 4);
        assert!(pool.lookup_prefix(&b_tokens).is_empty());
        assert!(pool.lookup_prefix(&b_tokens[4..]).is_empty());

        let b = admit(&mut pool, &b_tokens);
        assert!(a.iter().all(|x| !b.contains(x)), "{a:?} {b:?}");
        assert_eq!(pool.stats().cached_blocks, 4);
        let found = pool.lookup_prefix(&b_tokens);
        assert_eq!(found, b);
        pool.release_all(&found).unwrap();
        let found = pool.lookup_prefix(&a_tokens);
        assert_eq!(found, a);
        pool.release_all(&found).unwrap();
    }

    #[test]
    fn a_colliding_key_is_refused_by_the_stored_tokens() {
        let mut pool = BlockPool::with_hash(8, 2, weak_hash);
        // [1, 2] and [3, 0] share a key: the second can neither be found nor registered.
        let a = admit(&mut pool, &[1, 2]);
        assert!(pool.lookup_prefix(&[3, 0]).is_empty());
        let b = admit(&mut pool, &[3, 0]);
        assert_ne!(a, b);
        assert_eq!(pool.stats().cached_blocks, 1);
        assert!(pool.lookup_prefix(&[3, 0]).is_empty());
        let found = pool.lookup_prefix(&[1, 2]);
        assert_eq!(found, a);
        for t in [&a, &b, &found] {
            pool.release_all(t).unwrap();
        }
        pool.audit().unwrap();
    }

    #[test]
    fn a_colliding_key_is_refused_by_the_stored_parent() {
        // weak_hash ignores the parent, so [5, 6] has one key after any first block.
        let mut pool = BlockPool::with_hash(8, 2, weak_hash);
        let x = admit(&mut pool, &[1, 2, 5, 6]);
        let y = admit(&mut pool, &[1, 0]);
        assert_eq!(pool.stats().cached_blocks, 3);
        let found = pool.lookup_prefix(&[1, 0, 5, 6]);
        assert_eq!(found, y, "x[1] holds [5, 6] but extends x[0], not y[0]");
        for t in [&x, &y, &found] {
            pool.release_all(t).unwrap();
        }
        pool.audit().unwrap();
    }

    #[test]
    fn a_prefix_computed_twice_keeps_its_first_registration() {
        let mut pool = BlockPool::new(6, 2);
        let tokens = prompt(&[1, 2, 3], 2);
        // Both miss before either registers, as with two prompts prefilled in one batch.
        let a = pool.allocate_n(3).unwrap();
        let b = pool.allocate_n(3).unwrap();
        assert_eq!(pool.register_prefix(&a, &tokens), 3);
        assert_eq!(pool.register_prefix(&b, &tokens), 0);
        assert_eq!(
            pool.register_prefix(&a, &tokens),
            0,
            "registering again is a no-op"
        );
        pool.release_all(&b).unwrap();
        assert_eq!(pool.stats().cached_blocks, 3);
        // The duplicates went to the free list, so they are reused before the cache is touched.
        let reuse = pool.allocate_n(3).unwrap();
        assert!(reuse.iter().all(|x| b.contains(x)));
        assert_eq!(pool.stats().evictions, 0);
        pool.release_all(&reuse).unwrap();
        pool.release_all(&a).unwrap();
        pool.audit().unwrap();
    }

    #[test]
    fn a_block_after_a_duplicate_chains_to_the_registered_prefix() {
        let mut pool = BlockPool::new(6, 2);
        let a = pool.allocate_n(1).unwrap();
        let b = pool.allocate_n(2).unwrap();
        assert_eq!(pool.register_prefix(&a, &[1, 1]), 1);
        assert_eq!(pool.register_prefix(&b, &[1, 1, 2, 2]), 1);
        let found = pool.lookup_prefix(&[1, 1, 2, 2]);
        assert_eq!(found, [a[0], b[1]]);
        pool.release_all(&found).unwrap();
        pool.release_all(&b).unwrap();
        pool.release_all(&a).unwrap();
        pool.audit().unwrap();
    }

    #[test]
    fn evicting_a_prefix_block_frees_its_cached_descendants() {
        let mut pool = BlockPool::new(3, 1);
        let table = admit(&mut pool, &[1, 2, 3]);
        // Released head first, so the head is the LRU head, unlike with release_all.
        for &b in &table {
            pool.release(b).unwrap();
        }
        assert_eq!(pool.allocate(), Some(table[0]));
        assert_eq!(pool.stats().evictions, 3);
        assert_eq!(pool.stats().cached_blocks, 0);
        assert_eq!(pool.available(), 2);
        pool.audit().unwrap();
        // The orphans were freed, not left to be evicted: no more evictions are counted.
        pool.allocate_n(2).unwrap();
        assert_eq!(pool.stats().evictions, 3);
        pool.audit().unwrap();
    }

    #[test]
    fn a_held_child_outlives_its_parents_eviction_unregistered() {
        let mut pool = BlockPool::new(3, 1);
        let a = pool.allocate_n(1).unwrap();
        let b = pool.allocate_n(2).unwrap();
        assert_eq!(pool.register_prefix(&a, &[1]), 1);
        assert_eq!(pool.register_prefix(&b, &[1, 2]), 1, "b[1] hangs from a[0]");
        pool.release_all(&a).unwrap();
        assert_eq!(pool.allocate(), Some(a[0]), "the only evictable block");
        assert_eq!(pool.stats().cached_blocks, 0);
        assert_eq!(pool.refcount(b[1]), 1);
        assert!(pool.lookup_prefix(&[1, 2]).is_empty());
        pool.audit().unwrap();
        // Unregistered now, so its release frees it instead of caching it.
        pool.release_all(&b).unwrap();
        assert_eq!(pool.available(), 2);
        assert_eq!(pool.stats().cached_blocks, 0);
        pool.audit().unwrap();
    }

    #[test]
    fn allocate_n_takes_all_or_nothing() {
        let mut pool = BlockPool::new(4, 2);
        let cached = admit(&mut pool, &[1, 1]);
        pool.release_all(&cached).unwrap();
        let held = pool.allocate_n(2).unwrap();
        let stats = pool.stats();
        let refs: Vec<u32> = (0..4).map(|b| pool.refcount(b)).collect();

        for n in [3, 100, usize::MAX] {
            assert_eq!(pool.allocate_n(n), None);
            assert_eq!(pool.available(), 2);
            assert_eq!(pool.stats(), stats);
            assert_eq!((0..4).map(|b| pool.refcount(b)).collect::<Vec<_>>(), refs);
            pool.audit().unwrap();
        }
        assert_eq!(pool.allocate_n(0), Some(Vec::new()));
        // Exactly what is available succeeds, evicting the cached block.
        let rest = pool.allocate_n(2).unwrap();
        assert!(rest.contains(&cached[0]));
        assert_eq!(pool.stats().evictions, 1);
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.allocate_n(1), None);
        pool.release_all(&held).unwrap();
        pool.release_all(&rest).unwrap();
        assert_eq!(pool.available(), 4);
    }

    #[test]
    fn misuse_returns_an_error_and_leaves_the_pool_unchanged() {
        let mut pool = BlockPool::new(4, 2);
        let cached = admit(&mut pool, &[1, 1]);
        pool.release_all(&cached).unwrap();
        let held = pool.allocate().unwrap();
        let free = (0..4).find(|&b| b != held && b != cached[0]).unwrap();
        let before = (pool.stats(), pool.available(), pool.in_use(), pool.usage());
        let refs: Vec<u32> = (0..4).map(|b| pool.refcount(b)).collect();

        for b in [free, cached[0]] {
            assert_eq!(pool.release(b), Err(PoolError::NotHeld { block: b }));
            assert_eq!(pool.share(b), Err(PoolError::NotHeld { block: b }));
        }
        let out = PoolError::OutOfRange {
            block: 9,
            blocks: 4,
        };
        assert_eq!(pool.release(9), Err(out));
        assert_eq!(pool.share(9), Err(out));
        assert_eq!(
            pool.release(u32::MAX),
            Err(PoolError::OutOfRange {
                block: u32::MAX,
                blocks: 4
            })
        );
        assert_eq!(pool.refcount(9), 0);
        assert_eq!(pool.register_prefix(&[9, free], &[1, 2, 3, 4]), 0);
        assert_eq!(pool.register_prefix(&[free], &[5, 5]), 0, "nobody holds it");
        assert_eq!(pool.register_prefix(&[held], &[]), 0);
        assert_eq!(pool.register_prefix(&[], &[5, 5]), 0);

        assert_eq!(
            (pool.stats(), pool.available(), pool.in_use(), pool.usage()),
            before
        );
        assert_eq!((0..4).map(|b| pool.refcount(b)).collect::<Vec<_>>(), refs);
        pool.audit().unwrap();
        assert_eq!(
            out.to_string(),
            "cache block 9 is outside the pool of 4 blocks"
        );
        assert_eq!(
            PoolError::NotHeld { block: 2 }.to_string(),
            "cache block 2 is not held by any sequence"
        );
    }

    #[test]
    fn release_all_releases_the_good_entries_past_a_bad_one() {
        let mut pool = BlockPool::new(4, 2);
        let table = pool.allocate_n(2).unwrap();
        let bad = [table[0], 7, table[1]];
        assert_eq!(
            pool.release_all(&bad),
            Err(PoolError::OutOfRange {
                block: 7,
                blocks: 4
            })
        );
        assert_eq!((pool.in_use(), pool.available()), (0, 4));
    }

    #[test]
    fn a_shared_block_counts_once_in_use() {
        let mut pool = BlockPool::new(4, 2);
        let b = pool.allocate().unwrap();
        pool.share(b).unwrap();
        assert_eq!(pool.refcount(b), 2);
        assert_eq!(pool.in_use(), 1);
        assert_eq!(pool.usage(), 0.25);
        pool.release(b).unwrap();
        assert_eq!(pool.in_use(), 1);
        pool.release(b).unwrap();
        assert_eq!((pool.in_use(), pool.usage()), (0, 0.0));
    }

    #[test]
    fn lookup_counts_queries_in_whole_blocks() {
        let mut pool = BlockPool::new(4, 2);
        let table = admit(&mut pool, &[1, 2, 3, 4]);
        let hit = pool.lookup_prefix(&[1, 2, 3, 4, 5]);
        assert_eq!(hit, table);
        assert!(
            pool.lookup_prefix(&[1]).is_empty(),
            "a partial block is never a hit"
        );
        assert!(pool.lookup_prefix(&[]).is_empty());
        let stats = pool.stats();
        // admit's own lookup counts too.
        assert_eq!(
            (stats.queries, stats.queried_blocks, stats.hit_blocks),
            (4, 4, 2)
        );
        assert_eq!(stats.cached_blocks, 2);
    }

    #[test]
    fn degenerate_pools_do_not_panic() {
        let mut empty = BlockPool::new(0, 4);
        assert_eq!(
            (empty.total(), empty.available(), empty.usage()),
            (0, 0, 0.0)
        );
        assert_eq!(empty.allocate(), None);
        assert_eq!(empty.allocate_n(1), None);
        assert!(empty.lookup_prefix(&[1, 2, 3, 4]).is_empty());
        assert_eq!(
            empty.release(0),
            Err(PoolError::OutOfRange {
                block: 0,
                blocks: 0
            })
        );
        let mut zero_size = BlockPool::new(2, 0);
        assert_eq!(zero_size.block_size(), 1);
        let t = admit(&mut zero_size, &[3, 4]);
        assert_eq!(zero_size.lookup_prefix(&[3, 4]), t);
    }
}
