//! Payload encodings: how a run of f32 values (a parameter chunk in a pull reply, a gradient
//! chunk in a push) becomes bytes, in [`Encoding::F32`], [`Encoding::Bf16`] or
//! [`Encoding::Int8Block`], and [`ErrorFeedback`], which carries a lossy encoding's rounding
//! residual into the next push so that nothing is lost for good.
//!
//! Pure functions over slices: no I/O, no allocation once the caller's buffers are warm, and no
//! panic on any input. Encoders append to a caller-owned `Vec<u8>` (so a frame header and its
//! payload share one buffer); decoders fill a caller-owned `&mut [f32]` whose length is the
//! number of values the receiver expects, and check the exact byte length and every value or
//! scale before the result can be used. The byte layouts are specified, with worked examples, in
//! docs/protocol.md, section "Payload encodings".
//!
//! Negotiation is not here: a Hello lists the encodings a worker speaks, the Welcome names the
//! shard's choice for pulls and for pushes ([`Encoding::negotiate`]); a worker that lists none
//! gets [`Encoding::F32`].

use crate::error::{Error, Result};
use serde::{Deserialize, Deserializer, Serialize};

/// Block size of [`Encoding::INT8`], the int8 encoding a shard picks unless told otherwise.
///
/// An int8 payload of `n` values takes `n + 4·⌈n/B⌉` bytes, `(B + 4) / (4B)` of f32. Issue 8
/// asks for at most 27% of f32, so `B ≥ 50`; 256 gives 25.4%, which leaves room for the frame
/// header and the short last block, while each block still spans only two rows of the MLP's
/// 784×128 weight matrix, so one outlier coarsens the codes of at most 256 neighbours. Smaller
/// blocks buy precision that error feedback already recovers; larger ones save under 1.5 points.
pub const DEFAULT_INT8_BLOCK: u32 = 256;

/// The largest int8 block scale a decoder accepts: the largest f32 `s` for which `127·s` is
/// still finite (`0x7c01_0203`, about 2.679e36), so that every decoded value is finite. The
/// encoder never writes a larger one.
pub const MAX_INT8_SCALE: f32 = f32::from_bits(0x7c01_0203);

/// How the values of one payload are laid out on the wire. Serialized in snake case, the names
/// a Hello's `encodings` list uses: `"f32"`, `"bf16"`, `"int8_block"` (block
/// [`DEFAULT_INT8_BLOCK`]), or `{"int8_block":{"block":B}}` for any other block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "Repr", into = "Repr")]
pub enum Encoding {
    /// 4 bytes per value, IEEE 754 binary32 little-endian: what protocol version 1 sends.
    F32,
    /// 2 bytes per value: the top half of the f32, rounded to nearest even, little-endian.
    Bf16,
    /// Blocks of `block` values: one f32 scale per block, then one int8 code per value.
    Int8Block {
        /// Values per block (the last block may be shorter); at least 1.
        block: u32,
    },
}

impl Default for Encoding {
    /// [`Encoding::F32`], what a worker that lists no encodings gets.
    fn default() -> Self {
        Encoding::F32
    }
}

impl Encoding {
    /// int8 in blocks of [`DEFAULT_INT8_BLOCK`].
    pub const INT8: Encoding = Encoding::Int8Block {
        block: DEFAULT_INT8_BLOCK,
    };

    /// The name a Hello lists: `"f32"`, `"bf16"` or `"int8_block"` (whatever the block size).
    pub fn name(self) -> &'static str {
        match self {
            Encoding::F32 => "f32",
            Encoding::Bf16 => "bf16",
            Encoding::Int8Block { .. } => "int8_block",
        }
    }

    /// Stable numeric id for a frame header field: 0 f32, 1 bf16, 2 int8 blocks. The block size
    /// is not part of the id; a header that carries id 2 carries the block size next to it.
    pub fn id(self) -> u8 {
        match self {
            Encoding::F32 => 0,
            Encoding::Bf16 => 1,
            Encoding::Int8Block { .. } => 2,
        }
    }

    /// The encoding with header id `id`; `block` is used by id 2 only.
    ///
    /// # Errors
    /// [`Error::Malformed`] for an unknown id or block size 0.
    pub fn from_id(id: u8, block: u32) -> Result<Self> {
        match id {
            0 => Ok(Encoding::F32),
            1 => Ok(Encoding::Bf16),
            2 => Encoding::Int8Block { block }.validate(),
            _ => Err(Error::Malformed(format!(
                "unknown payload encoding id {id}"
            ))),
        }
    }

    /// Returns `self` if it is usable: every encoding is, except int8 with block size 0.
    ///
    /// # Errors
    /// [`Error::Malformed`] for `Int8Block { block: 0 }`.
    pub fn validate(self) -> Result<Self> {
        match self {
            Encoding::Int8Block { block: 0 } => Err(Error::Malformed(
                "int8_block needs a block size of at least 1".into(),
            )),
            e => Ok(e),
        }
    }

    /// Bytes a payload of `n` values takes: `4n`, `2n`, or `n + 4·⌈n/B⌉`. Saturates at
    /// `usize::MAX` (no real payload is that long), which is also the answer for the invalid
    /// block size 0.
    pub fn encoded_len(self, n: usize) -> usize {
        match self {
            Encoding::F32 => n.saturating_mul(4),
            Encoding::Bf16 => n.saturating_mul(2),
            Encoding::Int8Block { block: 0 } => usize::MAX,
            Encoding::Int8Block { block } => n
                .div_ceil(block as usize)
                .saturating_mul(4)
                .saturating_add(n),
        }
    }

    /// The number of values a payload of `bytes` bytes holds, the inverse of
    /// [`Encoding::encoded_len`]; `None` when no number of values has that length.
    pub fn decoded_len(self, bytes: usize) -> Option<usize> {
        match self {
            Encoding::F32 => whole(bytes, 4),
            Encoding::Bf16 => whole(bytes, 2),
            Encoding::Int8Block { block: 0 } => None,
            Encoding::Int8Block { block } => {
                // A full block takes block + 4 bytes; a short last block of k values, 4 + k.
                // In u64 so that block + 4 cannot overflow on 32-bit targets.
                let (bytes, block) = (bytes as u64, u64::from(block));
                let (full, rest) = (bytes / (block + 4), bytes % (block + 4));
                let n = match rest {
                    0 => full * block,
                    1..=4 => return None,
                    r => full * block + r - 4,
                };
                usize::try_from(n).ok()
            }
        }
    }

    /// The shard's choice for one direction: the first of its `preferred` encodings whose kind
    /// the worker `offered` (by name: a worker that speaks int8 blocks speaks any block size, so
    /// the shard's block size wins), else [`Encoding::F32`], which every worker speaks.
    pub fn negotiate(offered: &[Encoding], preferred: &[Encoding]) -> Encoding {
        preferred
            .iter()
            .copied()
            .find(|p| p.validate().is_ok() && offered.iter().any(|o| o.id() == p.id()))
            .unwrap_or(Encoding::F32)
    }

    /// Appends the encoding of `values` to `out` (clear it first to replace its contents); once
    /// `out` has the capacity, nothing is allocated.
    ///
    /// Callers pass finite values. The encoder checks that contract rather than send what the
    /// receiver would reject: NaN, ±infinity and, in bf16, values so large that they round to
    /// infinity (|x| ≥ 3.3961775e38, bits `0x7f7f_8000`) are refused. On error `out` is left as
    /// it was.
    ///
    /// # Errors
    /// [`Error::NotFinite`] with the index of the first offending value; [`Error::Malformed`]
    /// for int8 block size 0.
    pub fn encode(self, values: &[f32], out: &mut Vec<u8>) -> Result<()> {
        let start = out.len();
        let r = match self.validate()? {
            Encoding::F32 => encode_f32(values, out),
            Encoding::Bf16 => encode_bf16(values, out),
            Encoding::Int8Block { block } => encode_int8(values, block as usize, out),
        };
        if r.is_err() {
            out.truncate(start);
        }
        r
    }

    /// Decodes `bytes` into `out`, whose length is the number of values the receiver expects.
    /// The byte length must be exactly [`Encoding::encoded_len`]`(out.len())`, every f32 and bf16
    /// value finite, every int8 scale in `[0, MAX_INT8_SCALE]` and every int8 code in
    /// `[-127, 127]`, so every decoded value is finite. Never panics. On error `out` may be
    /// partly written: decode into scratch, never into live state.
    ///
    /// # Errors
    /// - [`Error::WrongLength`] when the bytes hold a whole number of values, but not
    ///   `out.len()`; [`Error::Malformed`] when they hold no whole number of values;
    /// - [`Error::NotFinite`] for a NaN or infinite f32 or bf16 value;
    /// - [`Error::Malformed`] for a NaN, infinite, negative or too large int8 scale, an int8
    ///   code of -128, or int8 block size 0.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) -> Result<()> {
        let enc = self.validate()?;
        if bytes.len() != enc.encoded_len(out.len()) {
            return Err(match enc.decoded_len(bytes.len()) {
                Some(got) => Error::WrongLength {
                    expected: out.len(),
                    got,
                },
                None => Error::Malformed(format!(
                    "{} bytes are not a whole {enc} payload",
                    bytes.len()
                )),
            });
        }
        match enc {
            Encoding::F32 => decode_f32(bytes, out),
            Encoding::Bf16 => decode_bf16(bytes, out),
            Encoding::Int8Block { block } => decode_int8(bytes, block as usize, out),
        }
    }
}

/// `bytes / size` when `size` divides `bytes` (`usize::is_multiple_of` is newer than the MSRV).
fn whole(bytes: usize, size: usize) -> Option<usize> {
    let rest = bytes % size;
    (rest == 0).then_some(bytes / size)
}

impl std::fmt::Display for Encoding {
    /// `f32`, `bf16`, `int8_block(256)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Encoding::Int8Block { block } => write!(f, "int8_block({block})"),
            e => f.write_str(e.name()),
        }
    }
}

/// Deserializes a list of encodings, skipping the entries this build does not know, so that a
/// Hello from a newer worker (which may list encodings added later) is still understood. Use as
/// `#[serde(default, deserialize_with = "crowdgrad_core::codec::known_encodings")]`.
///
/// # Errors
/// Only when the value is not a list.
pub fn known_encodings<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<Encoding>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Entry {
        Known(Encoding),
        Unknown(serde::de::IgnoredAny),
    }
    let entries = Vec::<Entry>::deserialize(d)?;
    Ok(entries
        .into_iter()
        .filter_map(|e| match e {
            Entry::Known(e) => Some(e),
            Entry::Unknown(_) => None,
        })
        .collect())
}

/// The serde form of [`Encoding`]: a bare name, or the explicit int8 form with its block.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum Repr {
    Name(Name),
    Explicit(Explicit),
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Name {
    F32,
    Bf16,
    Int8Block,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Explicit {
    Int8Block { block: u32 },
}

impl From<Encoding> for Repr {
    fn from(e: Encoding) -> Self {
        match e {
            Encoding::F32 => Repr::Name(Name::F32),
            Encoding::Bf16 => Repr::Name(Name::Bf16),
            Encoding::Int8Block {
                block: DEFAULT_INT8_BLOCK,
            } => Repr::Name(Name::Int8Block),
            Encoding::Int8Block { block } => Repr::Explicit(Explicit::Int8Block { block }),
        }
    }
}

impl TryFrom<Repr> for Encoding {
    type Error = Error;

    fn try_from(r: Repr) -> Result<Self> {
        match r {
            Repr::Name(Name::F32) => Ok(Encoding::F32),
            Repr::Name(Name::Bf16) => Ok(Encoding::Bf16),
            Repr::Name(Name::Int8Block) => Ok(Encoding::INT8),
            Repr::Explicit(Explicit::Int8Block { block }) => {
                Encoding::Int8Block { block }.validate()
            }
        }
    }
}

/// The encoder's state for error feedback (1-bit SGD, Seide et al. 2014; EF-SGD, Karimireddy et
/// al. 2019): the residual per coordinate, what lossy encoding has so far failed to deliver.
/// Each push encodes `grad + residual` and keeps `(grad + residual) − decode(encoded)` as the
/// new residual, so over many pushes the sum of what the shard decodes tracks the sum of the
/// true gradients within one residual (at most half a block scale per coordinate for int8).
///
/// One per (worker, shard) connection. [`ErrorFeedback::reset`] it on reconnect: the residual
/// refers to parameters the new session may not share.
#[derive(Debug, Clone, Default)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
    /// `grad + residual` of the push in progress; kept to avoid allocating per push.
    corrected: Vec<f32>,
}

impl ErrorFeedback {
    /// Zero residual for a payload of `n` values.
    pub fn new(n: usize) -> Self {
        ErrorFeedback {
            residual: vec![0.0; n],
            corrected: vec![0.0; n],
        }
    }

    /// Number of values per payload.
    pub fn len(&self) -> usize {
        self.residual.len()
    }

    /// True for a zero-length payload.
    pub fn is_empty(&self) -> bool {
        self.residual.is_empty()
    }

    /// The residual the next push adds to its gradient.
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Forgets the residual (on reconnect, or after the shard rejected a push whose residual
    /// should not be carried).
    pub fn reset(&mut self) {
        self.residual.fill(0.0);
    }

    /// Appends the encoding of `grad + residual` to `out` and keeps what the encoding lost as the
    /// next residual: `(grad + residual) − enc.decode(encoded)`, computed with the decoder the
    /// shard runs, so the two agree bit for bit. With [`Encoding::F32`] the residual becomes 0.
    ///
    /// # Errors
    /// [`Error::WrongLength`] if `grad.len() != self.len()`, or the errors of
    /// [`Encoding::encode`] (a non-finite `grad + residual`); on error `out` and the residual are
    /// left as they were.
    pub fn encode_with_feedback(
        &mut self,
        grad: &[f32],
        enc: Encoding,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        if grad.len() != self.residual.len() {
            return Err(Error::WrongLength {
                expected: self.residual.len(),
                got: grad.len(),
            });
        }
        if let Encoding::Int8Block { block } = enc.validate()? {
            // One pass per block instead of five over the whole payload (the same values, bit
            // for bit; see `encode_int8_with_feedback`).
            return self.encode_int8(grad, block as usize, out);
        }
        for ((c, g), r) in self.corrected.iter_mut().zip(grad).zip(&self.residual) {
            *c = g + r;
        }
        let start = out.len();
        enc.encode(&self.corrected, out)?;
        // The decoded values land in `residual`, then become corrected − decoded in place.
        if let Err(e) = enc.decode(&out[start..], &mut self.residual) {
            // Unreachable for bytes our own encoder wrote; keep a consistent state anyway.
            out.truncate(start);
            self.residual.fill(0.0);
            return Err(e);
        }
        for (r, c) in self.residual.iter_mut().zip(&self.corrected) {
            *r = c - *r;
        }
        Ok(())
    }

    /// [`ErrorFeedback::encode_with_feedback`] for int8 blocks, fused: per block of `block`
    /// values (L1-resident), `corrected = grad + residual`, its scale, its codes and the new
    /// residual `corrected − code · scale`, which is what [`Encoding::decode`] computes from
    /// these bytes, so the residual is the same bit for bit as the unfused encode, decode and
    /// subtract (five passes over the payload, 17% of a native worker's CPU per step by
    /// `perf`). The new residual is written to `corrected` and swapped in at the end, so an
    /// error leaves the residual (and `out`) as they were.
    fn encode_int8(&mut self, grad: &[f32], block: usize, out: &mut Vec<u8>) -> Result<()> {
        let n_blocks = grad.len().div_ceil(block);
        let start = out.len();
        out.resize(start + 4 * n_blocks + grad.len(), 0);
        let (scales, codes) = out[start..].split_at_mut(4 * n_blocks);
        let blocks = grad
            .chunks(block)
            .zip(self.residual.chunks(block))
            .zip(self.corrected.chunks_mut(block))
            .zip(scales.chunks_exact_mut(4))
            .zip(codes.chunks_mut(block));
        for (b, ((((g, r), c), s_out), q_out)) in blocks.enumerate() {
            for ((c, g), r) in c.iter_mut().zip(g).zip(r) {
                *c = g + r;
            }
            let scale = match int8_scale(c) {
                Some(s) => s,
                None => {
                    let e = first_not_finite(c, b * block);
                    out.truncate(start);
                    return Err(e);
                }
            };
            s_out.copy_from_slice(&scale.to_le_bytes());
            int8_quantise(c, scale, q_out);
            for (c, &q) in c.iter_mut().zip(q_out.iter()) {
                *c -= f32::from(q as i8) * scale;
            }
        }
        std::mem::swap(&mut self.residual, &mut self.corrected);
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The codecs. Loops are branch-free over values (a flag collects "not finite", the offending
// index is searched only on error) so they vectorise.

/// `|x|` as bits: for finite floats, integer order is float order, and anything at or above
/// this is infinite or NaN.
const ABS_MASK: u32 = 0x7fff_ffff;
const EXP_MASK: u32 = 0x7f80_0000;

/// The error for the first non-finite value of `values`, whose first value has index `offset`
/// in the payload. Called only once a check has found one.
fn first_not_finite(values: &[f32], offset: usize) -> Error {
    let (index, &value) = values
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .unwrap_or((0, &f32::NAN));
    Error::NotFinite {
        index: offset + index,
        value,
    }
}

fn encode_f32(values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let bad = values.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & EXP_MASK == EXP_MASK)
    });
    if bad != 0 {
        return Err(first_not_finite(values, 0));
    }
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        for v in values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    Ok(())
}

fn decode_f32(bytes: &[u8], out: &mut [f32]) -> Result<()> {
    if cfg!(target_endian = "little") {
        // The bytes are already the values: one memcpy, whatever the input's alignment.
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(bytes);
    } else {
        for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    let bad = out.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & EXP_MASK == EXP_MASK)
    });
    if bad != 0 {
        return Err(first_not_finite(out, 0));
    }
    Ok(())
}

/// f32 → bf16 bits, rounding to nearest, ties to even. Works on `|x|` so the addition cannot
/// wrap (a negative NaN would otherwise carry into zero); the result is ≥ 0x7f80 exactly when
/// it is not finite (NaN, ±infinity, or a finite value that rounds past bf16's largest).
#[inline(always)]
fn bf16_abs_round(bits: u32) -> u32 {
    let a = bits & ABS_MASK;
    (a + 0x7fff + ((a >> 16) & 1)) >> 16
}

fn encode_bf16(values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let start = out.len();
    out.resize(start + 2 * values.len(), 0);
    let mut bad = 0u32;
    for (o, v) in out[start..].chunks_exact_mut(2).zip(values) {
        let bits = v.to_bits();
        let r = bf16_abs_round(bits);
        bad |= u32::from(r >= 0x7f80);
        let h = (r | ((bits >> 16) & 0x8000)) as u16;
        o.copy_from_slice(&h.to_le_bytes());
    }
    if bad != 0 {
        let index = values
            .iter()
            .position(|v| bf16_abs_round(v.to_bits()) >= 0x7f80)
            .unwrap_or(0);
        let value = values.get(index).copied().unwrap_or(f32::NAN);
        return Err(Error::NotFinite { index, value });
    }
    Ok(())
}

fn decode_bf16(bytes: &[u8], out: &mut [f32]) -> Result<()> {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
    }
    // A second pass over the (cache-hot) output vectorises; folding the check into the
    // conversion loop did not, and ran 4x slower.
    let bad = out.iter().fold(0u32, |acc, v| {
        acc | u32::from(v.to_bits() & EXP_MASK == EXP_MASK)
    });
    if bad != 0 {
        return Err(first_not_finite(out, 0));
    }
    Ok(())
}

/// The int8 code of `v` (finite, `|v|` a little above 127 at most): clamped to ±127, then
/// rounded to nearest, ties to even, by adding 1.5·2^23. The sum's last significand bit is then
/// worth 1, so its bits are `0x4b40_0000 + q` and its low byte is `q` in two's complement. Plain
/// float and bit operations, so the loop vectorises on baseline x86-64 (SSE2) and on wasm, where
/// `round_ties_even` and a saturating `as i8` do not.
#[inline(always)]
fn int8_code(v: f32) -> u8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (v.clamp(-127.0, 127.0) + MAGIC).to_bits() as u8
}

fn encode_int8(values: &[f32], block: usize, out: &mut Vec<u8>) -> Result<()> {
    let n_blocks = values.len().div_ceil(block);
    let start = out.len();
    out.resize(start + 4 * n_blocks + values.len(), 0);
    let (scales, codes) = out[start..].split_at_mut(4 * n_blocks);
    for (b, ((x, s_out), q_out)) in values
        .chunks(block)
        .zip(scales.chunks_exact_mut(4))
        .zip(codes.chunks_mut(block))
        .enumerate()
    {
        let Some(scale) = int8_scale(x) else {
            return Err(first_not_finite(x, b * block));
        };
        s_out.copy_from_slice(&scale.to_le_bytes());
        int8_quantise(x, scale, q_out);
    }
    Ok(())
}

/// The int8 scale of block `x` (`max |x| / 127`, at most [`MAX_INT8_SCALE`]), or `None` when
/// it holds a NaN or an infinity.
#[inline(always)]
fn int8_scale(x: &[f32]) -> Option<f32> {
    // max |x| as an integer max over the magnitude bits: vectorises, and catches NaN and
    // infinities in the same pass (their bits are the largest).
    let max_bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & ABS_MASK));
    (max_bits < EXP_MASK).then(|| (f32::from_bits(max_bits) / 127.0).min(MAX_INT8_SCALE))
}

/// The codes of block `x` under `scale` (from [`int8_scale`]).
#[inline(always)]
fn int8_quantise(x: &[f32], scale: f32, q_out: &mut [u8]) {
    if scale >= f32::MIN_POSITIVE {
        let inv = 1.0 / scale;
        for (q, &v) in q_out.iter_mut().zip(x) {
            *q = int8_code(v * inv);
        }
    } else if scale > 0.0 {
        // Subnormal scale: 1/scale would overflow, so divide (rare, slow, exact enough).
        for (q, &v) in q_out.iter_mut().zip(x) {
            *q = int8_code(v / scale);
        }
    } else {
        // All zeros, or so tiny that max/127 underflows (max < 127 * 2^-150, about
        // 8.9e-44): every code is 0, and error feedback carries the values.
        q_out.fill(0);
    }
}

fn decode_int8(bytes: &[u8], block: usize, out: &mut [f32]) -> Result<()> {
    let n_blocks = out.len().div_ceil(block);
    let (scales, codes) = bytes.split_at(4 * n_blocks);
    // Scales first, all of them, before any value is written: the scale table is small
    // (1/64 of the payload at block 256) and contiguous.
    for (b, s) in scales.chunks_exact(4).enumerate() {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        // Also false for NaN.
        if !(0.0..=MAX_INT8_SCALE).contains(&s) {
            return Err(Error::Malformed(format!(
                "int8 block {b} has scale {s:e}; a scale is finite, >= 0 and <= {MAX_INT8_SCALE:e}"
            )));
        }
    }
    // The encoder clamps codes to [-127, 127]; -128 (0x80) would make 128 · MAX_INT8_SCALE,
    // which overflows to -infinity. Refused like a bad scale (found by fuzz/ `payload`).
    // A branch-free fold (vectorises: one compare per 16 codes); the index is searched only
    // once one is found. `position` alone went byte by byte and tripled the decode's time.
    let bad = codes.iter().fold(0u8, |acc, &q| acc | u8::from(q == 0x80));
    if bad != 0 {
        let i = codes.iter().position(|&q| q == 0x80).unwrap_or(0);
        return Err(Error::Malformed(format!(
            "int8 value {i} has code -128; codes are in [-127, 127]"
        )));
    }
    for ((o, q), s) in out
        .chunks_mut(block)
        .zip(codes.chunks(block))
        .zip(scales.chunks_exact(4))
    {
        let s = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for (o, &q) in o.iter_mut().zip(q) {
            *o = f32::from(q as i8) * s;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
