//! A sequence's text as it is generated: incremental detokenization, stop strings (the stop
//! text is cut, and a suffix that may start one is held back), and what became final with each
//! token. Shared by the single-sequence loop and the scheduler.

use std::ops::Deref;

use loader::tokenizer::{StreamDecoder, Tokenizer};

use crate::EngineError;

pub(crate) struct TextStream<T: Deref<Target = Tokenizer>> {
    decoder: Option<StreamDecoder<T>>,
    text: String,
    /// `text[..emitted]` has been handed out.
    emitted: usize,
    stop_hit: bool,
}

impl<T: Deref<Target = Tokenizer>> TextStream<T> {
    pub fn new(tokenizer: Option<T>) -> Self {
        TextStream {
            decoder: tokenizer.map(|t| StreamDecoder::new(t, true)),
            text: String::new(),
            emitted: 0,
            stop_hit: false,
        }
    }

    /// Adds token `id`; returns the text that became final with it and whether a stop
    /// string ended the text.
    pub fn push(&mut self, id: u32, stops: &[String]) -> Result<(String, bool), EngineError> {
        if let Some(d) = self.decoder.as_mut() {
            self.text.push_str(
                &d.push(id)
                    .map_err(|e| EngineError::Tokenizer(e.to_string()))?,
            );
        }
        self.stop_hit = false;
        if let Some(pos) = stops
            .iter()
            .filter_map(|s| self.text.find(s.as_str()))
            .min()
        {
            self.text.truncate(pos);
            self.stop_hit = true;
        }
        let ready = if self.stop_hit {
            self.text.len()
        } else {
            self.text.len() - held_back(&self.text, stops)
        };
        let delta = self.text[self.emitted.min(ready)..ready].to_string();
        self.emitted = self.emitted.max(ready);
        Ok((delta, self.stop_hit))
    }

    /// Ends the text: bytes the decoder still holds (an incomplete UTF-8 sequence) join it
    /// unless a stop string cut it short. Returns the whole text.
    pub fn finish(&mut self) -> String {
        if let Some(d) = self.decoder.as_mut()
            && !self.stop_hit
        {
            self.text.push_str(&d.finish());
        }
        std::mem::take(&mut self.text)
    }

    /// Bytes of text handed out so far.
    pub fn emitted(&self) -> usize {
        self.emitted
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of some stop string.
pub(crate) fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for s in stops {
        for k in (1..s.len()).rev() {
            if k <= text.len()
                && text.is_char_boundary(text.len() - k)
                && s.is_char_boundary(k)
                && text.ends_with(&s[..k])
            {
                hold = hold.max(k);
                break;
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn a_partial_stop_string_is_held_back() {
        let stops = vec!["</s>".to_string(), "END".to_string()];
        assert_eq!(held_back("hello </", &stops), 2);
        assert_eq!(held_back("hello EN", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
    }
}
