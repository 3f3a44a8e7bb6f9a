//! One evaluation point ([`EvalPoint`]): what the evaluator (`super::app::evaluator`) records,
//! the status and the dashboard stream (`super::dashboard`) carry, and the page plots. A file
//! of its own so both can name it without importing each other.

use serde::Serialize;

/// One evaluation of the parameters on the test set.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct EvalPoint {
    /// Seconds since the server started.
    pub time_s: f64,
    /// When, milliseconds since the Unix epoch (issue 19: a wall-clock axis).
    pub t_ms: u64,
    /// Mean shard version when the parameters were read (= applied steps when in step).
    pub step: u64,
    /// Examples behind all applied pushes at that time.
    pub samples: u64,
    /// Mean test loss.
    pub loss: f64,
    /// Test accuracy in [0, 1] (for a language model: of the next token, over positions).
    pub accuracy: f64,
    /// A language model's validation loss in bits per token (`loss / ln 2`; per character
    /// when the tokens are characters).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bits_per_token: Option<f64>,
}
