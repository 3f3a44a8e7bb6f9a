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
//!
//! Names: `softmax` (no hidden layer), `mlp:W1[,W2...]` (= `dense:W1,dense:W2,...`) and
//! [`CNN`] (`cnn`, the default convolutional network).
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
}

impl Layer {
    /// True for the layers that own parameters (`layer{i}.*` tensors).
    pub fn has_params(&self) -> bool {
        matches!(self, Layer::Dense { .. } | Layer::Conv { .. })
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
/// layer is the output `dense` to `classes` units (logits), with softmax cross-entropy on top.
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
    /// parameters / 2^24 activations per example.
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
    pub fn layers_text(&self) -> String {
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
    let items: Vec<String> = match t {
        "softmax" => Vec::new(),
        "cnn" => CNN.split(',').map(str::to_string).collect(),
        _ => match t.strip_prefix("mlp:") {
            Some(widths) => widths
                .split(',')
                .map(|w| format!("dense:{}", w.trim()))
                .collect(),
            None => t.split(',').map(|s| s.trim().to_string()).collect(),
        },
    };
    let mut layers = Vec::new();
    for item in &items {
        let layer = parse_item(item).map_err(|why| {
            Error::Config(format!(
                "bad layer {item:?} in model {t:?}: {why}; use softmax, mlp:W1,W2,..., cnn, or a comma list of conv:FxKxK[/sS][/pP], pool:K[/sS], avgpool:K[/sS], dense:W, dropout:P, flatten"
            ))
        })?;
        layers.push(layer);
        if layer.has_params() {
            layers.push(Layer::Relu);
        }
    }
    layers.push(Layer::Dense { units: classes });
    Ok(layers)
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
