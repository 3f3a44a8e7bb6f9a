//! Model specs: a list of [`Layer`]s over an input shape, their text grammar and their checks.
//!
//! # Grammar (`--model`)
//!
//! A model text is a name or a comma list of layers; ReLU is implied after every `conv` and
//! `dense` layer, and the output layer (`dense` to the dataset's classes, softmax cross-entropy
//! on top, no ReLU) is always appended:
//!
//! | text | layer |
//! |---|---|
//! | `conv:FxK` or `conv:FxKHxKW`, then optionally `/sS` (stride, default 1) and `/pP` (zero padding, default 0), e.g. `conv:32x5x5/p2`, `conv:16x3x3/s2p1` | 2-D convolution with F filters, then ReLU |
//! | `pool:K` or `maxpool:K`, optionally `/sS` (default K) | max-pooling over KxK windows |
//! | `avgpool:K`, optionally `/sS` | average-pooling |
//! | `dense:W` | fully connected, W units, then ReLU (flattens an image input) |
//! | `dropout:P` | drops each unit of the previous layer with probability P in training (`0 <= P < 1`) |
//! | `flatten` | explicit flatten (a `dense` after an image flattens by itself) |
//! | `embed:D/tT` | token and position embeddings of a language model: width D, context T (first layer) |
//! | `block:H` | a pre-LayerNorm transformer block with H heads (causal self-attention, then a 4D GELU MLP) |
//! | `lnorm` | the final LayerNorm over the width (after the last block) |
//! | `head:untied` | the output head with its own `[D, V]` weight (last); without it the head is tied to the token embedding |
//!
//! Names: `softmax` (no hidden layer), `mlp:W1[,W2...]` (= `dense:W1,dense:W2,...`),
//! [`CNN`] (`cnn`, the default convolutional network), `gpt:L,D,H,T` (= `embed:D/tT`, L times
//! `block:H`, `lnorm`: a character-level GPT, `model/gpt.rs`), `gpt:L,D,H,T/untied` (the same
//! with `head:untied`) and `gpt` (= [`GPT`]).
//!
//! A language model (`embed`, blocks, `lnorm`, head: exactly that order) reads examples of T+1
//! token ids (input shape `[T+1]`, the ids as exact f32 integers) and predicts tokens 1..=T
//! from tokens 0..T; its classes are the vocabulary V. Its output layer is the head (tied
//! unless `head:untied` ends the list), not `dense`. [`ModelSpec::sequence`] says whether a spec
//! is one, and its context.
//!
//! Images are `H x W x C`, channels last (the order of IDX `N x H x W x C` and of NumPy arrays);
//! a flattened image is indexed `(y * W + x) * C + c`. Convolution and pooling windows must fit
//! the input (`valid` pooling, output `floor((H + 2P - K) / S) + 1`).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// The text of the default convolutional network, `cnn`: two 5x5 convolutions with 2x2
/// max-pooling, one hidden dense layer (LeNet's shape, sized for a 2-core machine).
pub const CNN: &str = "conv:16x5x5,pool:2,conv:32x5x5,pool:2,dense:128";

/// The text of the default language model, `gpt`: 4 blocks of width 128 with 4 heads over a
/// context of 64 tokens (about 0.8M parameters with a vocabulary of 100).
pub const GPT: &str = "gpt:4,128,4,64";

/// Largest width `D` of a language model.
pub const MAX_GPT_WIDTH: usize = 4096;
/// Largest context `T` of a language model.
pub const MAX_GPT_CONTEXT: usize = 4096;
/// Largest number of blocks `L` of a language model.
pub const MAX_GPT_BLOCKS: usize = 64;
/// Largest vocabulary (classes) of a language model.
pub const MAX_GPT_VOCAB: usize = 65_536;

/// Largest parameter count a model may have.
pub const MAX_PARAMS: u128 = 1 << 31;
/// Largest number of activations (all layers together) of one example.
pub const MAX_ACTIVATIONS: usize = 1 << 24;
/// Largest im2col matrix of one example for one convolution (floats).
pub const MAX_PATCHES: usize = 1 << 26;

/// One layer of a model.
///
/// In JSON (the run spec) and in a TOML table a layer is an object tagged by `kind`, e.g.
/// `{"kind": "conv", "filters": 16, "kernel": [5, 5], "stride": 1, "padding": 0}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Layer {
    /// Fully connected: `layer{i}.weight` `[fan_in, units]`, `layer{i}.bias` `[units]`.
    Dense {
        /// Output units.
        units: usize,
    },
    /// 2-D convolution over `H x W x C`: `layer{i}.weight` `[KH, KW, C, filters]`,
    /// `layer{i}.bias` `[filters]`.
    Conv {
        /// Output channels.
        filters: usize,
        /// Kernel height and width.
        kernel: [usize; 2],
        /// Step between windows (both axes).
        stride: usize,
        /// Zeros added on every side (both axes).
        padding: usize,
    },
    /// Max over `size x size` windows, per channel.
    MaxPool {
        /// Window side.
        size: usize,
        /// Step between windows.
        stride: usize,
    },
    /// Mean over `size x size` windows, per channel.
    AvgPool {
        /// Window side.
        size: usize,
        /// Step between windows.
        stride: usize,
    },
    /// `max(0, x)`, element-wise.
    Relu,
    /// Image to vector (no computation: the memory layout is already flat).
    Flatten,
    /// In training, zeroes each unit with probability `rate` and scales the others by
    /// `1 / (1 - rate)` (inverted dropout); the identity in evaluation.
    Dropout {
        /// Probability of dropping a unit, `0 <= rate < 1`.
        rate: f32,
    },
    /// Token and position embeddings, the first layer of a language model: `tok_emb.weight`
    /// `[V, D]`, `pos_emb.weight` `[T, D]`.
    Embed {
        /// Width `D`.
        dim: usize,
        /// Context `T` (tokens per example, plus one target).
        context: usize,
    },
    /// A pre-LayerNorm transformer block (`block{i}.*`): `x += proj(attn(ln1(x)))`, then
    /// `x += mlp_proj(gelu(fc(ln2(x))))`.
    Block {
        /// Attention heads (they divide the width).
        heads: usize,
    },
    /// The final LayerNorm of a language model (`ln_f.weight`, `ln_f.bias`).
    LayerNorm,
    /// The output head of a language model: logits over the vocabulary, from the token
    /// embedding (tied) or its own `head.weight` `[D, V]`.
    Head {
        /// True when the head is the token embedding transposed (no tensor of its own).
        tied: bool,
    },
}

/// What a language model is ([`ModelSpec::sequence`]): its sizes, for cutting text into
/// windows of `context + 1` tokens and for labelling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    /// Context `T`: positions predicted per example (an example holds `T + 1` tokens).
    pub context: usize,
    /// Vocabulary `V` (the spec's classes).
    pub vocab: usize,
    /// Blocks `L`.
    pub layers: usize,
    /// Width `D`.
    pub dim: usize,
    /// Heads `H`.
    pub heads: usize,
    /// True when the head is tied to the token embedding.
    pub tied: bool,
}

impl SeqInfo {
    /// The model text, `gpt:L,D,H,T` (with `/untied` for an untied head).
    pub fn text(&self) -> String {
        let untied = if self.tied { "" } else { "/untied" };
        format!(
            "gpt:{},{},{},{}{untied}",
            self.layers, self.dim, self.heads, self.context
        )
    }

    /// The layer list of this model, head included.
    pub fn layers(&self) -> Vec<Layer> {
        let mut l = vec![Layer::Embed {
            dim: self.dim,
            context: self.context,
        }];
        l.extend((0..self.layers).map(|_| Layer::Block { heads: self.heads }));
        l.push(Layer::LayerNorm);
        l.push(Layer::Head { tied: self.tied });
        l
    }
}

impl Layer {
    /// True for the layers that own parameters (`layer{i}.*` tensors).
    /// (The layers of a language model name their tensors themselves: `model/gpt.rs`.)
    pub fn has_params(&self) -> bool {
        matches!(self, Layer::Dense { .. } | Layer::Conv { .. })
    }

    /// True for the layers of a language model (`embed`, `block`, `lnorm`, the head).
    pub fn is_sequence(&self) -> bool {
        matches!(
            self,
            Layer::Embed { .. } | Layer::Block { .. } | Layer::LayerNorm | Layer::Head { .. }
        )
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Layer::Dense { units } => write!(f, "dense:{units}"),
            Layer::Conv {
                filters,
                kernel,
                stride,
                padding,
            } => {
                write!(f, "conv:{filters}x{}x{}", kernel[0], kernel[1])?;
                if stride != 1 {
                    write!(f, "/s{stride}")?;
                }
                if padding != 0 {
                    write!(f, "/p{padding}")?;
                }
                Ok(())
            }
            Layer::MaxPool { size, stride } | Layer::AvgPool { size, stride } => {
                let name = if matches!(self, Layer::MaxPool { .. }) {
                    "pool"
                } else {
                    "avgpool"
                };
                write!(f, "{name}:{size}")?;
                if stride != size {
                    write!(f, "/s{stride}")?;
                }
                Ok(())
            }
            Layer::Relu => write!(f, "relu"),
            Layer::Flatten => write!(f, "flatten"),
            Layer::Dropout { rate } => write!(f, "dropout:{rate}"),
            Layer::Embed { dim, context } => write!(f, "embed:{dim}/t{context}"),
            Layer::Block { heads } => write!(f, "block:{heads}"),
            Layer::LayerNorm => write!(f, "lnorm"),
            Layer::Head { tied: true } => write!(f, "head"),
            Layer::Head { tied: false } => write!(f, "head:untied"),
        }
    }
}

/// The shape of the values between two layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// An image, `h x w x c`, channels last.
    Image {
        /// Height.
        h: usize,
        /// Width.
        w: usize,
        /// Channels.
        c: usize,
    },
    /// A vector.
    Flat(usize),
}

impl Shape {
    /// Number of values.
    pub fn len(&self) -> usize {
        match *self {
            Shape::Image { h, w, c } => h * w * c,
            Shape::Flat(n) => n,
        }
    }

    /// True for a shape with no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of one example whose dimensions are `dims` (`[n]`, `[h, w]` or `[h, w, c]`).
    ///
    /// # Errors
    /// [`Error::Config`] for no dimension, a zero dimension or more than three.
    pub fn of_dims(dims: &[usize]) -> Result<Self> {
        if dims.contains(&0) {
            return Err(Error::Config(format!("input shape {dims:?} has no values")));
        }
        match *dims {
            [n] => Ok(Shape::Flat(n)),
            [h, w] => Ok(Shape::Image { h, w, c: 1 }),
            [h, w, c] => Ok(Shape::Image { h, w, c }),
            _ => Err(Error::Config(format!(
                "input shape {dims:?}: a model takes [n], [h, w] or [h, w, c]"
            ))),
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Shape::Image { h, w, c } => write!(f, "{h}x{w}x{c}"),
            Shape::Flat(n) => write!(f, "{n}"),
        }
    }
}

/// Architecture of a model: an input shape, a list of layers and the class count. The last
/// layer is the output `dense` to `classes` units (logits), with softmax cross-entropy on top;
/// a language model's is its head, over a vocabulary of `classes` tokens, and its input shape
/// is `[T + 1]` ([`ModelSpec::sequence`]).
///
/// In JSON: `{"inputs": 784, "input_shape": [28, 28], "layers": [...], "classes": 10}`, plus
/// `"hidden": [W...]` when the model is a plain MLP (what protocol-1 workers before layers read;
/// a spec with only `hidden` still decodes). Decoding validates: a model that does not fit its
/// input does not decode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "SpecRepr", into = "SpecRepr")]
pub struct ModelSpec {
    /// Input features per example (784 for MNIST), the product of `input_shape`.
    pub inputs: usize,
    /// Shape of one example: `[n]`, `[h, w]` or `[h, w, c]`.
    pub input_shape: Vec<usize>,
    /// The layers, output layer included.
    pub layers: Vec<Layer>,
    /// Number of classes (the output layer's units).
    pub classes: usize,
}

#[derive(Serialize, Deserialize)]
struct SpecRepr {
    inputs: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    input_shape: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    hidden: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layers: Option<Vec<Layer>>,
    classes: usize,
}

impl TryFrom<SpecRepr> for ModelSpec {
    type Error = Error;

    fn try_from(r: SpecRepr) -> Result<Self> {
        let input_shape = r.input_shape.unwrap_or_else(|| vec![r.inputs]);
        let layers = match (r.layers, r.hidden) {
            (Some(layers), _) => layers,
            (None, Some(hidden)) => mlp_layers(&hidden, r.classes),
            (None, None) => {
                return Err(Error::Config("model has neither layers nor hidden".into()))
            }
        };
        if input_shape.iter().product::<usize>() != r.inputs {
            return Err(Error::Config(format!(
                "input shape {input_shape:?} does not have {} values",
                r.inputs
            )));
        }
        Self::from_layers(input_shape, layers, r.classes)
    }
}

impl From<ModelSpec> for SpecRepr {
    fn from(s: ModelSpec) -> Self {
        SpecRepr {
            inputs: s.inputs,
            hidden: s.mlp_widths(),
            input_shape: Some(s.input_shape),
            layers: Some(s.layers),
            classes: s.classes,
        }
    }
}

fn is_spatial(l: &Layer) -> bool {
    matches!(
        l,
        Layer::Conv { .. } | Layer::MaxPool { .. } | Layer::AvgPool { .. }
    )
}

fn mlp_layers(hidden: &[usize], classes: usize) -> Vec<Layer> {
    let mut layers = Vec::new();
    for &units in hidden {
        layers.push(Layer::Dense { units });
        layers.push(Layer::Relu);
    }
    layers.push(Layer::Dense { units: classes });
    layers
}

/// One checked layer with its input and output shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resolved {
    /// The layer.
    pub layer: Layer,
    /// Its input.
    pub input: Shape,
    /// Its output.
    pub output: Shape,
}

impl ModelSpec {
    /// Parses a model text (module docs: the grammar) for examples of `inputs` features.
    ///
    /// Callers that know the examples' shape use [`ModelSpec::parse_shaped`]; this one is for a
    /// flat feature count: convolution and pooling then read a square count as a square
    /// one-channel image (784 as 28x28x1).
    ///
    /// # Errors
    /// As [`ModelSpec::parse_shaped`].
    pub fn parse(text: &str, inputs: usize, classes: usize) -> Result<Self> {
        let layers = parse_layers(text, classes)?;
        let spatial = layers.iter().any(is_spatial);
        let side = (inputs as f64).sqrt().round() as usize;
        let shape = if spatial && side * side == inputs {
            vec![side, side]
        } else {
            vec![inputs]
        };
        Self::from_layers(shape, layers, classes)
    }

    /// Parses a language model's text (`gpt`, `gpt:L,D,H,T`, or `embed:D/tT,...`) for a
    /// vocabulary of `vocab` tokens: its input shape, `[T + 1]`, comes from the text, so a
    /// caller can learn the context (and cut its text into windows of `T + 1`) from the model
    /// text alone.
    ///
    /// # Errors
    /// [`Error::Config`] for text outside the grammar, a model that is not a language model,
    /// or one that fails [`ModelSpec::validate`].
    pub fn parse_sequence(text: &str, vocab: usize) -> Result<Self> {
        let layers = parse_layers(text, vocab)?;
        let Some(&Layer::Embed { context, .. }) = layers.first() else {
            return Err(Error::Config(format!(
                "model {:?} is not a language model (gpt:L,D,H,T or embed:D/tT,...)",
                text.trim()
            )));
        };
        Self::from_layers(vec![context.saturating_add(1)], layers, vocab)
    }

    /// Checks a model text against the grammar only, before the examples' shape is known
    /// (shapes are checked by [`ModelSpec::parse_shaped`] when it is).
    ///
    /// # Errors
    /// [`Error::Config`] for text outside the grammar, naming the layer.
    pub fn check_text(text: &str) -> Result<()> {
        parse_layers(text, 2).map(|_| ())
    }

    /// Parses a model text (module docs: the grammar) for examples of shape `input_shape`
    /// (`[n]`, `[h, w]` or `[h, w, c]`) and `classes` classes.
    ///
    /// # Errors
    /// [`Error::Config`] for text outside the grammar, or a model that does not fit (naming the
    /// layer and the shape), has fewer than 2 classes or is too large.
    pub fn parse_shaped(text: &str, input_shape: &[usize], classes: usize) -> Result<Self> {
        let layers = parse_layers(text, classes)?;
        Self::from_layers(input_shape.to_vec(), layers, classes)
    }

    /// A spec from its parts, validated.
    ///
    /// # Errors
    /// As [`ModelSpec::validate`].
    pub fn from_layers(
        input_shape: Vec<usize>,
        layers: Vec<Layer>,
        classes: usize,
    ) -> Result<Self> {
        // A model without convolution or pooling flattens its input, so its input shape is
        // stored flat (`[784]` for 28x28 images): its spec and JSON do not depend on the
        // images' shape, as before layers existed (old checkpoints still match).
        let inputs = input_shape.iter().product();
        let input_shape = if layers.iter().any(is_spatial) {
            input_shape
        } else {
            vec![inputs]
        };
        let spec = Self {
            inputs,
            input_shape,
            layers,
            classes,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks that every layer fits its input and the whole is usable.
    ///
    /// # Errors
    /// [`Error::Config`] naming the first layer that does not fit and its input shape, fewer
    /// than 2 classes, a last layer that is not `dense` to `classes`, or more than 2^31
    /// parameters / 2^24 activations per example. A language model: its layers out of the
    /// order `embed`, blocks, `lnorm`, head, blocks with different heads, `D % H != 0`, an
    /// input that is not `[T + 1]`, or sizes over [`MAX_GPT_WIDTH`], [`MAX_GPT_CONTEXT`],
    /// [`MAX_GPT_BLOCKS`], [`MAX_GPT_VOCAB`] and the same parameter and activation limits (its
    /// training workspace per example).
    pub fn validate(&self) -> Result<()> {
        self.resolve().map(|_| ())
    }

    /// Every layer with its input and output shape.
    ///
    /// # Errors
    /// As [`ModelSpec::validate`].
    pub fn resolve(&self) -> Result<Vec<Resolved>> {
        let bad = |m: String| Err(Error::Config(m));
        if self.classes < 2 {
            return bad(format!(
                "a model needs at least 2 classes, not {}",
                self.classes
            ));
        }
        let mut shape = Shape::of_dims(&self.input_shape)?;
        if shape.len() != self.inputs {
            return bad(format!(
                "input shape {:?} has {} values, not inputs = {}",
                self.input_shape,
                shape.len(),
                self.inputs
            ));
        }
        if self.layers.iter().any(Layer::is_sequence) {
            return self.resolve_sequence(shape);
        }
        match self.layers.last() {
            Some(Layer::Dense { units }) if *units == self.classes => {}
            _ => {
                return bad(format!(
                    "the last layer must be dense:{} (the {} classes)",
                    self.classes, self.classes
                ))
            }
        }
        let mut out = Vec::with_capacity(self.layers.len());
        let (mut params, mut acts) = (0u128, 0usize);
        let mut prev: Option<Layer> = None;
        for (i, &layer) in self.layers.iter().enumerate() {
            let at = |why: String| {
                Error::Config(format!(
                    "layer {i} ({layer}) does not fit its input {shape}: {why}"
                ))
            };
            let output = match layer {
                Layer::Dense { units } => {
                    if units == 0 || units > 65_536 {
                        return Err(at(format!("{units} units is outside 1..=65536")));
                    }
                    params += (shape.len() as u128 + 1) * units as u128;
                    Shape::Flat(units)
                }
                Layer::Conv {
                    filters,
                    kernel: [kh, kw],
                    stride,
                    padding,
                } => {
                    let Shape::Image { h, w, c } = shape else {
                        return Err(at("a convolution needs an image, not a vector".into()));
                    };
                    if filters == 0 || filters > 4096 || kh == 0 || kw == 0 || stride == 0 {
                        return Err(at(
                            "filters, kernel and stride must be positive (filters at most 4096)"
                                .into(),
                        ));
                    }
                    if padding >= kh.max(kw) {
                        return Err(at(format!(
                            "padding {padding} must be smaller than the {kh}x{kw} kernel"
                        )));
                    }
                    let (ph, pw) = (h + 2 * padding, w + 2 * padding);
                    if kh > ph || kw > pw {
                        return Err(at(format!(
                            "the {kh}x{kw} kernel is larger than the {ph}x{pw} padded image"
                        )));
                    }
                    let (oh, ow) = ((ph - kh) / stride + 1, (pw - kw) / stride + 1);
                    if (oh * ow).saturating_mul(kh * kw * c) > MAX_PATCHES {
                        return Err(at("its im2col matrix is too large".into()));
                    }
                    params += (kh as u128 * kw as u128 * c as u128 + 1) * filters as u128;
                    Shape::Image {
                        h: oh,
                        w: ow,
                        c: filters,
                    }
                }
                Layer::MaxPool { size, stride } | Layer::AvgPool { size, stride } => {
                    let Shape::Image { h, w, c } = shape else {
                        return Err(at("pooling needs an image, not a vector".into()));
                    };
                    if size == 0 || stride == 0 {
                        return Err(at("pool size and stride must be positive".into()));
                    }
                    if size > h || size > w {
                        return Err(at(format!(
                            "the {size}x{size} window is larger than the {h}x{w} image"
                        )));
                    }
                    Shape::Image {
                        h: (h - size) / stride + 1,
                        w: (w - size) / stride + 1,
                        c,
                    }
                }
                Layer::Relu | Layer::Dropout { .. } if prev.is_none() => {
                    return Err(at(
                        "ReLU and dropout act on a layer's output; put a layer before".into(),
                    ));
                }
                Layer::Relu => shape,
                Layer::Dropout { rate } => {
                    if !(rate.is_finite() && (0.0..1.0).contains(&rate)) {
                        return Err(at(format!("dropout rate {rate} is outside [0, 1)")));
                    }
                    if matches!(prev, Some(Layer::Dropout { .. })) {
                        return Err(at("two dropouts in a row".into()));
                    }
                    shape
                }
                Layer::Flatten => Shape::Flat(shape.len()),
                Layer::Embed { .. }
                | Layer::Block { .. }
                | Layer::LayerNorm
                | Layer::Head { .. } => {
                    // resolve_sequence() takes every model with one of these.
                    return Err(at("a language-model layer in a layer stack".into()));
                }
            };
            acts = acts.saturating_add(output.len());
            if params > MAX_PARAMS {
                return Err(at(format!("the model has {params} parameters, too many")));
            }
            if acts > MAX_ACTIVATIONS {
                return Err(at("too many activations per example".into()));
            }
            out.push(Resolved {
                layer,
                input: shape,
                output,
            });
            shape = output;
            prev = Some(layer);
        }
        Ok(out)
    }

    /// The structure of a language model's layer list: `Ok(None)` when it has no
    /// language-model layer, `Err` naming what is out of place.
    fn sequence_form(&self) -> std::result::Result<Option<SeqInfo>, String> {
        if !self.layers.iter().any(Layer::is_sequence) {
            return Ok(None);
        }
        let form =
            "a language model is embed:D/tT, block:H (1 or more, the same H), lnorm, then its head";
        if let Some((i, l)) = self
            .layers
            .iter()
            .enumerate()
            .find(|(_, l)| !l.is_sequence())
        {
            return Err(format!(
                "{form}; layer {i} ({l}) is out of place (not a language-model layer)"
            ));
        }
        let n = self.layers.len();
        let (Some(Layer::Embed { dim, context }), Some(Layer::Head { tied })) =
            (self.layers.first(), self.layers.last())
        else {
            return Err(format!(
                "{form}; it must start with embed and end with the head"
            ));
        };
        if n < 4 || self.layers[n - 2] != Layer::LayerNorm {
            return Err(format!("{form}; lnorm must come right before the head"));
        }
        let mut heads = None;
        for (i, l) in self.layers[1..n - 2].iter().enumerate() {
            match (l, heads) {
                (Layer::Block { heads: h }, None) => heads = Some(*h),
                (Layer::Block { heads: h }, Some(first)) if *h == first => {}
                (Layer::Block { heads: h }, Some(first)) => {
                    return Err(format!(
                        "{form}; layer {} (block:{h}) has other heads than block:{first}",
                        i + 1
                    ))
                }
                (other, _) => {
                    return Err(format!("{form}; layer {} ({other}) is out of place", i + 1))
                }
            }
        }
        Ok(Some(SeqInfo {
            context: *context,
            vocab: self.classes,
            layers: n - 3,
            dim: *dim,
            heads: heads.unwrap_or(0),
            tied: *tied,
        }))
    }

    /// The sizes of a language model (module docs: `embed`, `block`, `lnorm`, head), `None`
    /// for every other model (and for a list that is not a valid language model).
    pub fn sequence(&self) -> Option<SeqInfo> {
        self.sequence_form().ok().flatten()
    }

    /// [`ModelSpec::resolve`] for a language model: the structure, its sizes and limits.
    fn resolve_sequence(&self, input: Shape) -> Result<Vec<Resolved>> {
        let info = match self.sequence_form() {
            Ok(Some(info)) => info,
            Ok(None) => return Err(Error::Config("not a language model".into())),
            Err(why) => return Err(Error::Config(why)),
        };
        let bad = |m: String| Err(Error::Config(format!("model {}: {m}", info.text())));
        let SeqInfo {
            context: t,
            vocab: v,
            layers: l,
            dim: d,
            heads: h,
            ..
        } = info;
        if !(1..=MAX_GPT_WIDTH).contains(&d) {
            return bad(format!("width {d} is outside 1..={MAX_GPT_WIDTH}"));
        }
        if !(1..=MAX_GPT_CONTEXT).contains(&t) {
            return bad(format!("context {t} is outside 1..={MAX_GPT_CONTEXT}"));
        }
        if !(1..=MAX_GPT_BLOCKS).contains(&l) {
            return bad(format!("{l} blocks is outside 1..={MAX_GPT_BLOCKS}"));
        }
        if h == 0 || d % h != 0 {
            return bad(format!(
                "{h} heads do not divide the width {d} (D % H != 0)"
            ));
        }
        if v > MAX_GPT_VOCAB {
            return bad(format!("a vocabulary of {v} is over {MAX_GPT_VOCAB}"));
        }
        if input != Shape::Flat(t + 1) {
            return bad(format!(
                "an example holds T+1 = {} tokens, but the input is {input}",
                t + 1
            ));
        }
        let params = super::gpt::param_count(&info);
        if params > MAX_PARAMS {
            return bad(format!(
                "{params} parameters, too many (at most {MAX_PARAMS})"
            ));
        }
        let acts = super::gpt::floats_per_example(&info, true);
        if acts > MAX_ACTIVATIONS as u128 {
            return bad(format!(
                "{acts} activations per example, too many (at most {MAX_ACTIVATIONS})"
            ));
        }
        let stream = Shape::Flat(t * d);
        Ok(self
            .layers
            .iter()
            .enumerate()
            .map(|(i, &layer)| Resolved {
                layer,
                input: if i == 0 { input } else { stream },
                output: if i + 1 == self.layers.len() {
                    Shape::Flat(t * v)
                } else {
                    stream
                },
            })
            .collect())
    }

    /// Hidden widths when the model is a plain MLP (`dense` + ReLU layers, then the output),
    /// `Some(vec![])` for softmax regression; `None` for anything else.
    pub fn mlp_widths(&self) -> Option<Vec<usize>> {
        let (last, hidden) = self.layers.split_last()?;
        if !matches!(last, Layer::Dense { .. }) || hidden.len() % 2 != 0 {
            return None;
        }
        hidden
            .chunks(2)
            .map(|p| match p {
                [Layer::Dense { units }, Layer::Relu] => Some(*units),
                _ => None,
            })
            .collect()
    }

    /// The hidden layers' text in the grammar (implied ReLUs and the output layer left out).
    /// A language model's is its name, `gpt:L,D,H,T` (`/untied`).
    pub fn layers_text(&self) -> String {
        if let Some(info) = self.sequence() {
            return info.text();
        }
        let n = self.layers.len().saturating_sub(1);
        let mut items: Vec<String> = Vec::new();
        for (i, l) in self.layers[..n].iter().enumerate() {
            let implied = matches!(l, Layer::Relu) && i > 0 && self.layers[i - 1].has_params();
            if !implied {
                items.push(l.to_string());
            }
        }
        items.join(",")
    }

    /// The flat parameter layout: `layer{i}.weight` then `layer{i}.bias` for the i-th layer
    /// with parameters.
    pub fn layout(&self) -> super::ParamLayout {
        let mut l = super::ParamLayout::default();
        let Ok(resolved) = self.resolve() else {
            return l;
        };
        if let Some(info) = self.sequence() {
            return super::gpt::layout(&info);
        }
        for (i, r) in resolved.iter().filter(|r| r.layer.has_params()).enumerate() {
            match (r.layer, r.input) {
                (Layer::Dense { units }, input) => {
                    l.push(format!("layer{i}.weight"), vec![input.len(), units]);
                    l.push(format!("layer{i}.bias"), vec![units]);
                }
                (
                    Layer::Conv {
                        filters, kernel, ..
                    },
                    Shape::Image { c, .. },
                ) => {
                    l.push(
                        format!("layer{i}.weight"),
                        vec![kernel[0], kernel[1], c, filters],
                    );
                    l.push(format!("layer{i}.bias"), vec![filters]);
                }
                _ => {}
            }
        }
        l
    }

    /// Number of parameters.
    pub fn param_len(&self) -> usize {
        self.layout().len()
    }
}

impl fmt::Display for ModelSpec {
    /// `softmax 784-10`, `mlp 784-128-10`, or the layers text with the shapes, e.g.
    /// `conv:16x5x5,pool:2,dense:128 28x28x1-10`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let input = Shape::of_dims(&self.input_shape)
            .map(|s| s.to_string())
            .unwrap_or_else(|_| self.inputs.to_string());
        match self.mlp_widths() {
            Some(hidden) => {
                let mut dims = vec![self.inputs.to_string()];
                dims.extend(hidden.iter().map(ToString::to_string));
                dims.push(self.classes.to_string());
                let kind = if hidden.is_empty() { "softmax" } else { "mlp" };
                write!(f, "{kind} {}", dims.join("-"))
            }
            _ => write!(f, "{} {input}-{}", self.layers_text(), self.classes),
        }
    }
}

/// Parses the text into the full layer list (implied ReLUs and the output layer added).
fn parse_layers(text: &str, classes: usize) -> Result<Vec<Layer>> {
    let t = text.trim();
    let gpt = if t == "gpt" { GPT } else { t };
    let items: Vec<String> = match t {
        "softmax" => Vec::new(),
        "cnn" => CNN.split(',').map(str::to_string).collect(),
        _ => match (t.strip_prefix("mlp:"), gpt.strip_prefix("gpt:")) {
            (Some(widths), _) => widths
                .split(',')
                .map(|w| format!("dense:{}", w.trim()))
                .collect(),
            (None, Some(sizes)) => gpt_items(sizes).map_err(|why| {
                Error::Config(format!(
                    "bad model {t:?}: {why}; use gpt:L,D,H,T (L blocks, width D, H heads, context T), optionally /untied"
                ))
            })?,
            (None, None) => t.split(',').map(|s| s.trim().to_string()).collect(),
        },
    };
    let mut layers = Vec::new();
    for item in &items {
        let layer = parse_item(item).map_err(|why| {
            Error::Config(format!(
                "bad layer {item:?} in model {t:?}: {why}; use softmax, mlp:W1,W2,..., cnn, gpt:L,D,H,T, or a comma list of conv:FxKxK[/sS][/pP], pool:K[/sS], avgpool:K[/sS], dense:W, dropout:P, flatten (or of embed:D/tT, block:H, lnorm, head:untied)"
            ))
        })?;
        layers.push(layer);
        if layer.has_params() {
            layers.push(Layer::Relu);
        }
    }
    // The output layer: a language model's head (tied unless the list ends with one), else
    // dense to the classes.
    if layers.iter().any(Layer::is_sequence) {
        if !matches!(layers.last(), Some(Layer::Head { .. })) {
            layers.push(Layer::Head { tied: true });
        }
    } else {
        layers.push(Layer::Dense { units: classes });
    }
    Ok(layers)
}

/// `L,D,H,T[/untied]` of `gpt:L,D,H,T` into its layer items.
fn gpt_items(sizes: &str) -> std::result::Result<Vec<String>, String> {
    let (sizes, untied) = match sizes.split_once('/') {
        None => (sizes, false),
        Some((s, "untied")) => (s, true),
        Some((_, other)) => return Err(format!("unknown option {other:?} (only /untied)")),
    };
    let n: Vec<usize> = sizes
        .split(',')
        .map(|v| number(v.trim(), "gpt size"))
        .collect::<std::result::Result<_, _>>()?;
    let [l, d, h, t] = n[..] else {
        return Err(format!("gpt wants 4 sizes L,D,H,T, not {}", n.len()));
    };
    if l > MAX_GPT_BLOCKS {
        return Err(format!("{l} blocks is outside 1..={MAX_GPT_BLOCKS}"));
    }
    let mut items = vec![format!("embed:{d}/t{t}")];
    items.extend((0..l).map(|_| format!("block:{h}")));
    items.push("lnorm".into());
    if untied {
        items.push("head:untied".into());
    }
    Ok(items)
}

fn number(s: &str, what: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=65_536).contains(&n) => Ok(n),
        Ok(0) if what == "padding" => Ok(0),
        _ => Err(format!("{what} {s:?} is not a number in 1..=65536")),
    }
}

/// `/s2/p1`, `/s2p1`, `/p2`: stride and padding options after a layer.
fn options(rest: &str) -> std::result::Result<(Option<usize>, Option<usize>), String> {
    let (mut stride, mut pad) = (None, None);
    if !rest.is_ascii() {
        return Err(format!("unknown option {rest:?}"));
    }
    let s: String = rest.chars().filter(|&c| c != '/').collect();
    let mut chars = s.as_str();
    while !chars.is_empty() {
        let key = chars.as_bytes()[0];
        let digits = chars[1..]
            .find(|c: char| !c.is_ascii_digit())
            .map_or(chars.len(), |n| n + 1);
        let value = &chars[1..digits];
        match key {
            b's' if stride.is_none() => stride = Some(number(value, "stride")?),
            b'p' if pad.is_none() => pad = Some(number(value, "padding")?),
            _ => {
                return Err(format!(
                    "unknown option {chars:?} (use /sS and /pP once each)"
                ))
            }
        }
        chars = &chars[digits..];
    }
    Ok((stride, pad))
}

fn parse_item(item: &str) -> std::result::Result<Layer, String> {
    let (name, arg) = item.split_once(':').unwrap_or((item, ""));
    let (arg, opts) = arg.split_once('/').unwrap_or((arg, ""));
    match name {
        "embed" => {
            let context = opts
                .strip_prefix('t')
                .ok_or_else(|| "embed wants embed:D/tT (width D, context T)".to_string())?;
            return Ok(Layer::Embed {
                dim: number(arg, "width")?,
                context: number(context, "context")?,
            });
        }
        "block" if opts.is_empty() => {
            return Ok(Layer::Block {
                heads: number(arg, "heads")?,
            })
        }
        "lnorm" if arg.is_empty() && opts.is_empty() => return Ok(Layer::LayerNorm),
        "head" if opts.is_empty() => {
            return match arg {
                "" | "tied" => Ok(Layer::Head { tied: true }),
                "untied" => Ok(Layer::Head { tied: false }),
                _ => Err("head is head:tied or head:untied".into()),
            }
        }
        _ => {}
    }
    let (stride, padding) = options(opts)?;
    let no_opts = |l: Layer| {
        if stride.is_some() || padding.is_some() {
            Err(format!("{name} takes no /s or /p option"))
        } else {
            Ok(l)
        }
    };
    match name {
        "dense" => no_opts(Layer::Dense {
            units: number(arg, "width")?,
        }),
        "conv" => {
            let dims = arg
                .split('x')
                .map(|d| number(d, "conv dimension"))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let (filters, kernel) = match dims[..] {
                [f, k] => (f, [k, k]),
                [f, kh, kw] => (f, [kh, kw]),
                _ => return Err("conv wants FILTERSxK or FILTERSxKHxKW".into()),
            };
            Ok(Layer::Conv {
                filters,
                kernel,
                stride: stride.unwrap_or(1),
                padding: padding.unwrap_or(0),
            })
        }
        "pool" | "maxpool" | "avgpool" => {
            if padding.is_some() {
                return Err("pooling takes no padding".into());
            }
            let size = number(arg, "pool size")?;
            let stride = stride.unwrap_or(size);
            Ok(if name == "avgpool" {
                Layer::AvgPool { size, stride }
            } else {
                Layer::MaxPool { size, stride }
            })
        }
        "dropout" => {
            let rate: f32 = arg
                .parse()
                .map_err(|_| format!("dropout rate {arg:?} is not a number"))?;
            if !(0.0..1.0).contains(&rate) {
                return Err(format!("dropout rate {rate} is outside [0, 1)"));
            }
            no_opts(Layer::Dropout { rate })
        }
        "flatten" if arg.is_empty() => no_opts(Layer::Flatten),
        "relu" => Err("ReLU is implied after every conv and dense layer".into()),
        _ => Err("unknown layer".into()),
    }
}

#[cfg(test)]
mod tests;
