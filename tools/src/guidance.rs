//! Structured outputs through llguidance: the vocabulary as its token trie, a grammar (a JSON
//! schema, a Lark grammar, a tool-call block) compiled per request, and the engine's
//! [`TokenConstraint`] over an llguidance `Matcher`. The constraint applies to the answer: while
//! the model reasons (a prompt that opens `<think>`), every token but a turn's end is allowed
//! until `</think>`.

use std::sync::Arc;

use engine::{TokenConstraint, TokenMask};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use loader::tokenizer::Tokenizer;
use serde_json::{Value, json};

/// The vocabulary as llguidance sees it: each token's bytes, a special token as `0xFF` and its
/// name (never text; a grammar names it as `<[id]>`).
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Only used to force tokens; greedy over the trie, so forcing is off (not canonical).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Built once at load; makes a matcher per constrained request.
pub struct Guidance {
    factory: ParserFactory,
    /// `</think>`: the constraint starts after it when the output opens in reasoning.
    think_end: Option<u32>,
    eos: u32,
    /// Every token but the turn's ends: what reasoning may hold, so that a constrained turn
    /// cannot end before its answer.
    reasoning: TokenMask,
}

impl Guidance {
    /// `eos` ends a constrained answer (the grammar allows only it once complete).
    /// `turn_ends` are the tokens that end a chat turn.
    pub fn new(
        tok: &Tokenizer,
        eos: u32,
        think_end: Option<u32>,
        turn_ends: &[u32],
    ) -> anyhow::Result<Guidance> {
        let n = tok.vocab_size();
        let all: Vec<u32> = (0..n as u32).filter(|id| !turn_ends.contains(id)).collect();
        let reasoning = TokenMask::of(n, &all);
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                tok.token_bytes(id).unwrap_or_else(|| {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tok.token_to_piece(id).unwrap_or_default().into_bytes());
                    w
                })
            })
            .collect();
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_end_of_turn = Some(eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.set_stderr_log_level(0);
        Ok(Guidance {
            factory,
            think_end,
            eos,
            reasoning,
        })
    }

    /// A constraint to `grammar`, or why llguidance refuses the grammar. With
    /// `opens_reasoning`, the output starts inside reasoning and the grammar after `</think>`.
    pub fn constraint(
        &self,
        grammar: &TopLevelGrammar,
        opens_reasoning: bool,
    ) -> Result<Box<dyn TokenConstraint>, String> {
        let parser = self
            .factory
            .create_parser(grammar.clone())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Box::new(Guided {
            matcher,
            waiting_for: if opens_reasoning {
                self.think_end
            } else {
                None
            },
            eos: self.eos,
            reasoning: self.reasoning.clone(),
        }))
    }
}

struct Guided {
    matcher: Matcher,
    /// Reasoning (any token but a turn's end) until this token (`</think>`) is taken.
    waiting_for: Option<u32>,
    eos: u32,
    reasoning: TokenMask,
}

impl TokenConstraint for Guided {
    fn next_mask(&mut self) -> Result<Option<TokenMask>, String> {
        if self.waiting_for.is_some() {
            return Ok(Some(self.reasoning.clone()));
        }
        let v = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("the output constraint failed: {e}"))?;
        Ok(Some(TokenMask {
            words: v.as_slice().to_vec(),
        }))
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        if let Some(end) = self.waiting_for {
            if token == end {
                self.waiting_for = None;
            }
            return Ok(());
        }
        if token == self.eos && self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("the output constraint refused token {token}: {e}"))
    }
}

/// JSON as the constraint writes it: `", "` and `": "` between items, no other whitespace, so
/// the output is the compact form a client expects and a weak model cannot pad it forever.
pub fn compact(mut schema: Value, lenient: bool) -> Value {
    if let Value::Object(m) = &mut schema
        && !m.contains_key("x-guidance")
    {
        m.insert(
            "x-guidance".into(),
            json!({
                "item_separator": ", ",
                "key_separator": ": ",
                "whitespace_flexible": false,
                "lenient": lenient,
            }),
        );
    }
    schema
}

/// A JSON schema as a grammar; `strict` refuses keywords llguidance cannot enforce.
pub fn json_schema_grammar(schema: &Value, strict: bool) -> TopLevelGrammar {
    TopLevelGrammar::from_json_schema(compact(schema.clone(), !strict))
}

/// A Lark string literal: the text, quoted and escaped as JSON (Lark reads JSON escapes).
pub fn lark_literal(s: &str) -> String {
    Value::from(s).to_string()
}
