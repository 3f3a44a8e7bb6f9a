//! Text as a dataset: the vocabulary and tokenizer ([`TextInfo`], [`TextLevel`]) and the cut of a
//! token stream into training rows ([`windows`]).
//!
//! A text run keeps the image pipeline whole: its [`Dataset`] holds `N` rows of `T + 1` token
//! ids (one byte each, so at most 256 tokens), `image_dims = [T + 1]`, and the label of a row is
//! its last token (a character model reads inputs `tok[0..T]` and targets `tok[1..T+1]` from the
//! row itself and ignores the label, which only keeps `Dataset` and the IDX files whole). Batches
//! carry the ids exactly because the run's [`super::Normalize`] is in token mode.
//!
//! The rules (shared with the Python peer, so stated exactly):
//! - Level `chars`: tokens are Unicode scalar values. The vocabulary is the distinct characters
//!   of the training text sorted by code point, ids `0..n`, then one `unknown` id `n` for any
//!   other character, so `V = n + 1`. When the training text has more than
//!   [`MAX_VOCAB_CHARS`] distinct characters, the most frequent ones are kept (ties: the lower
//!   code point) and the rest map to `unknown`.
//! - Level `bytes`: tokens are the bytes of the file, `V = 256`, no unknown id.
//! - Windows: rows start at tokens `0, T, 2T, ...` and hold `T + 1` tokens (row `k` covers
//!   `kT..=kT+T`), so every token after the first is a target exactly once per pass and
//!   contiguous rows are a contiguous token range (a partition is one stretch of text); a tail
//!   shorter than `T + 1` is dropped.

use super::{Dataset, IdxArray};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Most characters a `chars` vocabulary keeps: with the `unknown` id, 256 ids, one byte each.
pub const MAX_VOCAB_CHARS: usize = 255;

/// Longest context a text run may use (tokens per row minus one).
pub const MAX_CONTEXT: usize = 4096;

/// What one token is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TextLevel {
    /// A Unicode scalar value of a UTF-8 text, through the run's vocabulary.
    #[default]
    Chars,
    /// A byte of the file, any bytes.
    Bytes,
}

impl TextLevel {
    /// Parses `chars` or `bytes`.
    ///
    /// # Errors
    /// [`Error::Config`] for any other text.
    pub fn parse(text: &str) -> Result<Self> {
        match text.trim() {
            "chars" => Ok(Self::Chars),
            "bytes" => Ok(Self::Bytes),
            t => Err(Error::Config(format!(
                "bad text level {t:?}: use chars or bytes"
            ))),
        }
    }
}

impl std::fmt::Display for TextLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Chars => "chars",
            Self::Bytes => "bytes",
        })
    }
}

/// The tokenizer of a text run, stated in the run spec (`DataInfo::text`): its level and, for
/// `chars`, the vocabulary. The server decodes samples with it and encodes prompts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextInfo {
    /// What one token is.
    pub level: TextLevel,
    /// For `chars`: the characters of ids `0..n` in id order (sorted by code point; id `n` is
    /// `unknown`). Empty for `bytes`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vocab: String,
}

impl TextInfo {
    /// The `bytes` tokenizer (`V = 256`).
    pub fn bytes() -> Self {
        Self {
            level: TextLevel::Bytes,
            vocab: String::new(),
        }
    }

    /// The `chars` vocabulary of a training text: its distinct characters sorted by code point,
    /// at most [`MAX_VOCAB_CHARS`] (the most frequent, ties by the lower code point).
    pub fn chars_of(train: &str) -> Self {
        let mut counts: HashMap<char, u64> = HashMap::new();
        for c in train.chars() {
            *counts.entry(c).or_insert(0) += 1;
        }
        let mut chars: Vec<(char, u64)> = counts.into_iter().collect();
        if chars.len() > MAX_VOCAB_CHARS {
            chars.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            chars.truncate(MAX_VOCAB_CHARS);
        }
        let mut kept: Vec<char> = chars.into_iter().map(|(c, _)| c).collect();
        kept.sort_unstable();
        Self {
            level: TextLevel::Chars,
            vocab: kept.into_iter().collect(),
        }
    }

    /// Tokens of this tokenizer, `V`: the vocabulary plus `unknown` for `chars`, 256 for
    /// `bytes`. The run's class count.
    pub fn vocab_size(&self) -> usize {
        match self.level {
            TextLevel::Chars => self.vocab.chars().count() + 1,
            TextLevel::Bytes => 256,
        }
    }

    /// The `unknown` id (`chars` only).
    pub fn unknown(&self) -> Option<u8> {
        match self.level {
            // vocab_size() <= 256 once validated; saturate rather than wrap before that.
            TextLevel::Chars => Some(u8::try_from(self.vocab_size() - 1).unwrap_or(u8::MAX)),
            TextLevel::Bytes => None,
        }
    }

    /// Checks a tokenizer received from elsewhere.
    ///
    /// # Errors
    /// [`Error::Config`] when a `chars` vocabulary is not strictly increasing by code point or
    /// has more than [`MAX_VOCAB_CHARS`] characters, or a `bytes` one has a vocabulary.
    pub fn validate(&self) -> Result<()> {
        match self.level {
            TextLevel::Chars => {
                let n = self.vocab.chars().count();
                if n > MAX_VOCAB_CHARS {
                    return Err(Error::Config(format!(
                        "text vocabulary has {n} characters, at most {MAX_VOCAB_CHARS}"
                    )));
                }
                let sorted = self
                    .vocab
                    .chars()
                    .zip(self.vocab.chars().skip(1))
                    .all(|(a, b)| a < b);
                if !sorted {
                    return Err(Error::Config(
                        "text vocabulary is not sorted by code point without repeats".into(),
                    ));
                }
            }
            TextLevel::Bytes => {
                if !self.vocab.is_empty() {
                    return Err(Error::Config("a bytes-level text has no vocabulary".into()));
                }
            }
        }
        Ok(())
    }

    /// The token ids of `text` (a prompt, or a whole file): for `chars` each character's id, or
    /// `unknown` for a character outside the vocabulary; for `bytes` its UTF-8 bytes.
    pub fn encode(&self, text: &str) -> Vec<u8> {
        match self.level {
            TextLevel::Bytes => text.as_bytes().to_vec(),
            TextLevel::Chars => {
                let vocab: Vec<char> = self.vocab.chars().collect();
                let unknown = self.unknown().unwrap_or(u8::MAX);
                // Most text is ASCII: a table for it, a binary search for the rest.
                let mut ascii = [unknown; 128];
                for (id, &c) in vocab.iter().enumerate() {
                    if c.is_ascii() {
                        ascii[c as usize] = id as u8;
                    }
                }
                text.chars()
                    .map(|c| {
                        if c.is_ascii() {
                            ascii[c as usize]
                        } else {
                            vocab.binary_search(&c).map_or(unknown, |id| id as u8)
                        }
                    })
                    .collect()
            }
        }
    }

    /// The text of token ids (a sample): for `chars` each id's character, `U+FFFD` for
    /// `unknown` and for ids outside the vocabulary; for `bytes` the bytes read as UTF-8, each
    /// invalid sequence replaced by `U+FFFD`.
    pub fn decode(&self, ids: &[u8]) -> String {
        match self.level {
            TextLevel::Bytes => String::from_utf8_lossy(ids).into_owned(),
            TextLevel::Chars => {
                let vocab: Vec<char> = self.vocab.chars().collect();
                ids.iter()
                    .map(|&id| {
                        vocab
                            .get(id as usize)
                            .copied()
                            .unwrap_or(char::REPLACEMENT_CHARACTER)
                    })
                    .collect()
            }
        }
    }
}

/// Rows of `context + 1` tokens that [`windows`] cuts from `tokens` tokens: `(tokens - 1) /
/// context`, or 0 when fewer than `context + 1` tokens (or a context of 0).
pub fn window_count(tokens: usize, context: usize) -> usize {
    if context == 0 || tokens <= context {
        0
    } else {
        (tokens - 1) / context
    }
}

/// The training rows of a token stream: row `k` is `tokens[k*T ..= k*T + T]` (stride `T`), its
/// label its last token; a tail shorter than `T + 1` is dropped. `image_dims` is `[T + 1]`.
///
/// # Errors
/// [`Error::Config`] for a context of 0 or above [`MAX_CONTEXT`]; [`Error::Data`] when the
/// stream holds no full row.
pub fn windows(tokens: &[u8], context: usize) -> Result<Dataset> {
    if context == 0 || context > MAX_CONTEXT {
        return Err(Error::Config(format!(
            "text context {context} is outside 1..={MAX_CONTEXT}"
        )));
    }
    let n = window_count(tokens.len(), context);
    if n == 0 {
        return Err(Error::Data(format!(
            "{} tokens hold no window of {} (context {context} + 1)",
            tokens.len(),
            context + 1
        )));
    }
    let row = context + 1;
    let mut data = Vec::with_capacity(n * row);
    let mut labels = Vec::with_capacity(n);
    for k in 0..n {
        let w = &tokens[k * context..k * context + row];
        data.extend_from_slice(w);
        labels.push(w[context]);
    }
    Dataset::from_arrays(
        IdxArray {
            dims: vec![n, row],
            data,
        },
        IdxArray {
            dims: vec![n],
            data: labels,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chars_round_trip_and_unknown_characters_map_to_one_id() {
        let train = "hello, wörld\n";
        let t = TextInfo::chars_of(train);
        t.validate().unwrap();
        // Distinct: '\n' ' ' ',' 'd' 'e' 'h' 'l' 'o' 'r' 'w' 'ö', sorted by code point.
        assert_eq!(t.vocab, "\n ,dehlorwö");
        assert_eq!(t.vocab_size(), 12);
        assert_eq!(t.unknown(), Some(11));
        let ids = t.encode(train);
        assert_eq!(ids.len(), train.chars().count());
        assert_eq!(ids[0], 5); // 'h'
        assert_eq!(t.decode(&ids), train);
        // Unseen characters (ASCII and not) are the unknown id; it decodes to U+FFFD.
        let ids = t.encode("hÿz!");
        assert_eq!(ids, [5, 11, 11, 11]);
        assert_eq!(t.decode(&ids), "h\u{FFFD}\u{FFFD}\u{FFFD}");
        // Ids past V (a model's bad output) decode, never panic.
        assert_eq!(t.decode(&[200, 0]), "\u{FFFD}\n");
    }

    #[test]
    fn bytes_round_trip_any_bytes() {
        let t = TextInfo::bytes();
        t.validate().unwrap();
        assert_eq!(t.vocab_size(), 256);
        assert_eq!(t.unknown(), None);
        let text = "naïve 🙂\n";
        let ids = t.encode(text);
        assert_eq!(ids, text.as_bytes());
        assert_eq!(t.decode(&ids), text);
        // Invalid UTF-8 decodes lossily.
        assert_eq!(t.decode(&[b'a', 0xff, b'b']), "a\u{FFFD}b");
    }

    #[test]
    fn the_vocabulary_keeps_the_255_most_frequent_characters() {
        // 300 distinct characters; character i (from U+0100) appears 1 + i / 2 times, so the
        // counts tie in pairs and the tie is broken by the lower code point.
        let mut train = String::new();
        for i in 0..300u32 {
            let c = char::from_u32(0x100 + i).unwrap();
            for _ in 0..=(i / 2) {
                train.push(c);
            }
        }
        let t = TextInfo::chars_of(&train);
        t.validate().unwrap();
        assert_eq!(t.vocab.chars().count(), MAX_VOCAB_CHARS);
        assert_eq!(t.vocab_size(), 256);
        assert_eq!(t.unknown(), Some(255));
        // 45 are dropped: i = 0..=43 (counts 1..=22) and, of the tied pair i = 44, 45 (count
        // 23), the higher code point 45.
        let kept: Vec<u32> = t.vocab.chars().map(|c| c as u32 - 0x100).collect();
        assert_eq!(kept.len(), 255);
        assert_eq!(*kept.last().unwrap(), 299);
        assert_eq!(kept[0], 44);
        assert!(!kept.contains(&45));
        assert!(kept.windows(2).all(|w| w[0] < w[1]));
        // Dropped characters are unknown.
        let ids = t.encode("\u{100}\u{12D}\u{12C}");
        assert_eq!(ids, [255, 255, 0]);
        // A vocabulary of 256 characters, or unsorted, is refused.
        let mut big = t.clone();
        big.vocab.push('\u{FFFF}');
        assert!(big.validate().is_err());
        let unsorted = TextInfo {
            level: TextLevel::Chars,
            vocab: "ba".into(),
        };
        assert!(unsorted.validate().is_err());
        let bytes_with_vocab = TextInfo {
            level: TextLevel::Bytes,
            vocab: "a".into(),
        };
        assert!(bytes_with_vocab.validate().is_err());
    }

    #[test]
    fn windows_have_stride_t_contiguity_and_their_last_token_as_label() {
        let tokens: Vec<u8> = (0..23u8).collect();
        let t = 5;
        let d = windows(&tokens, t).unwrap();
        // (23 - 1) / 5 = 4 rows: 0..=5, 5..=10, 10..=15, 15..=20; tokens 21, 22 are a tail.
        assert_eq!(d.len(), 4);
        assert_eq!(d.len(), window_count(tokens.len(), t));
        assert_eq!(d.image_dims, [t + 1]);
        for k in 0..d.len() {
            let row = d.pixels(k);
            assert_eq!(row, &tokens[k * t..=k * t + t]);
            assert_eq!(d.labels()[k], row[t]);
            if k > 0 {
                // Each row starts where the previous one ended: contiguous token ranges.
                assert_eq!(row[0], d.pixels(k - 1)[t]);
            }
        }
        // Exactly T + 1 tokens: one row; T tokens: none.
        assert_eq!(windows(&tokens[..6], t).unwrap().len(), 1);
        assert_eq!(window_count(5, t), 0);
        assert!(windows(&tokens[..5], t).is_err());
        assert!(windows(&tokens, 0).is_err());
        assert!(windows(&tokens, MAX_CONTEXT + 1).is_err());
        // Every token after the first is a target exactly once per pass.
        let targets: Vec<u8> = (0..d.len())
            .flat_map(|k| d.pixels(k)[1..].to_vec())
            .collect();
        assert_eq!(targets, &tokens[1..=20]);
    }

    #[test]
    fn levels_parse_and_print() {
        for l in [TextLevel::Chars, TextLevel::Bytes] {
            assert_eq!(TextLevel::parse(&l.to_string()).unwrap(), l);
        }
        assert!(TextLevel::parse("words").is_err());
        let t = TextInfo::chars_of("ab\n");
        let json = serde_json::to_value(&t).unwrap();
        assert_eq!(json["level"], "chars");
        assert_eq!(json["vocab"], "\nab");
        assert_eq!(serde_json::from_value::<TextInfo>(json).unwrap(), t);
        let b = serde_json::to_value(TextInfo::bytes()).unwrap();
        assert_eq!(b, serde_json::json!({"level": "bytes"}));
    }
}
