//! The loops around the GEMM: im2col / col2im for convolutions and the pooling windows. Images
//! are `h x w x c`, channels last, one example after another.

/// A convolution's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConvGeom {
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub kh: usize,
    pub kw: usize,
    pub filters: usize,
    pub stride: usize,
    pub pad: usize,
    pub oh: usize,
    pub ow: usize,
}

impl ConvGeom {
    /// Values of one input image.
    pub fn in_len(&self) -> usize {
        self.h * self.w * self.c
    }

    /// Output positions of one image (rows of its im2col matrix).
    pub fn positions(&self) -> usize {
        self.oh * self.ow
    }

    /// Length of one patch (columns of the im2col matrix, rows of the weight).
    pub fn patch(&self) -> usize {
        self.kh * self.kw * self.c
    }

    /// Calls `f(row, ky, kx0, kx1, src)` for every output position and kernel row of image `n`
    /// of `images`: `row` is the im2col row, `[kx0, kx1)` the kernel columns inside the image
    /// and `src` the offset of kernel column `kx0` in the image (the rest is zero padding).
    #[inline]
    fn for_each_run(&self, images: usize, mut f: impl FnMut(usize, usize, usize, usize, usize)) {
        let (s, p) = (self.stride as isize, self.pad as isize);
        let (h, w) = (self.h as isize, self.w as isize);
        let mut row = 0;
        for n in 0..images {
            let base = n * self.in_len();
            for oy in 0..self.oh as isize {
                for ox in 0..self.ow as isize {
                    let x0 = ox * s - p;
                    let kx0 = (-x0).max(0) as usize;
                    let kx1 = ((w - x0).min(self.kw as isize)).max(0) as usize;
                    for ky in 0..self.kh {
                        let iy = oy * s + ky as isize - p;
                        if iy < 0 || iy >= h || kx0 >= kx1 {
                            f(row, ky, 0, 0, 0);
                            continue;
                        }
                        let src = base + ((iy * w + x0 + kx0 as isize) as usize) * self.c;
                        f(row, ky, kx0, kx1, src);
                    }
                    row += 1;
                }
            }
        }
    }
}

/// Writes the im2col matrix of `images` images (`input`, `images * in_len` values) into `cols`
/// (`images * positions` rows of `patch` values, ordered `(ky, kx, c)` like the weight).
pub(crate) fn im2col(g: &ConvGeom, input: &[f32], images: usize, cols: &mut [f32]) {
    let (patch, run) = (g.patch(), g.kw * g.c);
    g.for_each_run(images, |row, ky, kx0, kx1, src| {
        let dst = &mut cols[row * patch + ky * run..row * patch + (ky + 1) * run];
        let (a, b) = (kx0 * g.c, kx1 * g.c);
        dst[..a].fill(0.0);
        dst[a.max(b)..].fill(0.0);
        if b > a {
            dst[a..b].copy_from_slice(&input[src..src + (b - a)]);
        }
    });
}

/// Adds the im2col-shaped gradient `cols` back onto the images' gradient `grad` (which the
/// caller zeroed): the transpose of [`im2col`].
pub(crate) fn col2im(g: &ConvGeom, cols: &[f32], images: usize, grad: &mut [f32]) {
    let (patch, run) = (g.patch(), g.kw * g.c);
    g.for_each_run(images, |row, ky, kx0, kx1, src| {
        let (a, b) = (kx0 * g.c, kx1 * g.c);
        if b > a {
            let from = &cols[row * patch + ky * run + a..row * patch + ky * run + b];
            for (d, &v) in grad[src..src + (b - a)].iter_mut().zip(from) {
                *d += v;
            }
        }
    });
}

/// A pooling layer's geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PoolGeom {
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub size: usize,
    pub stride: usize,
    pub oh: usize,
    pub ow: usize,
    /// Max (true) or average.
    pub max: bool,
}

impl PoolGeom {
    fn in_len(&self) -> usize {
        self.h * self.w * self.c
    }

    fn out_len(&self) -> usize {
        self.oh * self.ow * self.c
    }

    /// Offset in the image of window `(oy, ox)`'s pixel `(ky, kx)`, channel 0.
    #[inline]
    fn at(&self, oy: usize, ox: usize, ky: usize, kx: usize) -> usize {
        ((oy * self.stride + ky) * self.w + ox * self.stride + kx) * self.c
    }
}

/// Pools `images` images; a max-pool records the winning input offset of every output in
/// `argmax` (the backward pass needs it; unused for an average pool).
pub(crate) fn pool_forward(
    g: &PoolGeom,
    input: &[f32],
    images: usize,
    out: &mut [f32],
    argmax: &mut [u32],
) {
    let (il, ol, c) = (g.in_len(), g.out_len(), g.c);
    let inv = 1.0 / (g.size * g.size) as f32;
    for n in 0..images {
        let img = &input[n * il..(n + 1) * il];
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let o = n * ol + (oy * g.ow + ox) * c;
                let dst = &mut out[o..o + c];
                if g.max {
                    dst.fill(f32::NEG_INFINITY);
                    let arg = &mut argmax[o..o + c];
                    for ky in 0..g.size {
                        for kx in 0..g.size {
                            let at = g.at(oy, ox, ky, kx);
                            let src = &img[at..at + c];
                            let at = at as u32;
                            for (ch, ((d, a), &v)) in
                                dst.iter_mut().zip(arg.iter_mut()).zip(src).enumerate()
                            {
                                // Branch-free (the winner is unpredictable): a mask of
                                // all ones where `v` wins, as the compiler would not.
                                let win = 0u32.wrapping_sub(u32::from(v > *d));
                                *a ^= (*a ^ (at + ch as u32)) & win;
                                *d = f32::from_bits((d.to_bits() & !win) | (v.to_bits() & win));
                            }
                        }
                    }
                } else {
                    dst.fill(0.0);
                    for ky in 0..g.size {
                        for kx in 0..g.size {
                            let at = g.at(oy, ox, ky, kx);
                            for (d, &v) in dst.iter_mut().zip(&img[at..at + c]) {
                                *d += v;
                            }
                        }
                    }
                    dst.iter_mut().for_each(|d| *d *= inv);
                }
            }
        }
    }
}

/// The input gradient of a pooling layer into `grad` (overwritten) from the output gradient.
pub(crate) fn pool_backward(
    g: &PoolGeom,
    dout: &[f32],
    argmax: &[u32],
    images: usize,
    grad: &mut [f32],
) {
    let (il, ol, c) = (g.in_len(), g.out_len(), g.c);
    grad[..images * il].fill(0.0);
    let inv = 1.0 / (g.size * g.size) as f32;
    for n in 0..images {
        let gimg = &mut grad[n * il..(n + 1) * il];
        let d = &dout[n * ol..(n + 1) * ol];
        if g.max {
            for (&dv, &a) in d.iter().zip(&argmax[n * ol..(n + 1) * ol]) {
                gimg[a as usize] += dv;
            }
            continue;
        }
        for oy in 0..g.oh {
            for ox in 0..g.ow {
                let o = (oy * g.ow + ox) * c;
                for ky in 0..g.size {
                    for kx in 0..g.size {
                        let at = g.at(oy, ox, ky, kx);
                        for (gv, &dv) in gimg[at..at + c].iter_mut().zip(&d[o..o + c]) {
                            *gv += dv * inv;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(h: usize, w: usize, c: usize, k: usize, stride: usize, pad: usize) -> ConvGeom {
        ConvGeom {
            h,
            w,
            c,
            kh: k,
            kw: k,
            filters: 1,
            stride,
            pad,
            oh: (h + 2 * pad - k) / stride + 1,
            ow: (w + 2 * pad - k) / stride + 1,
        }
    }

    /// im2col against the definition, element by element, with padding and stride.
    #[test]
    fn im2col_matches_the_definition() {
        for &(h, w, c, k, s, p) in &[(5, 4, 2, 3, 1, 1), (6, 6, 1, 2, 2, 0), (4, 5, 3, 3, 2, 2)] {
            let g = geom(h, w, c, k, s, p);
            let input: Vec<f32> = (0..2 * g.in_len()).map(|i| i as f32 + 1.0).collect();
            let mut cols = vec![f32::NAN; 2 * g.positions() * g.patch()];
            im2col(&g, &input, 2, &mut cols);
            for n in 0..2 {
                for oy in 0..g.oh {
                    for ox in 0..g.ow {
                        for ky in 0..k {
                            for kx in 0..k {
                                for ch in 0..c {
                                    let iy = (oy * s + ky) as isize - p as isize;
                                    let ix = (ox * s + kx) as isize - p as isize;
                                    let want =
                                        if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize
                                        {
                                            0.0
                                        } else {
                                            input[n * g.in_len()
                                                + ((iy as usize * w) + ix as usize) * c
                                                + ch]
                                        };
                                    let row = n * g.positions() + oy * g.ow + ox;
                                    let got = cols[row * g.patch() + (ky * k + kx) * c + ch];
                                    assert_eq!(got, want, "{h}x{w}x{c} k{k} s{s} p{p}");
                                }
                            }
                        }
                    }
                }
            }
            // col2im is its transpose: <im2col(x), y> == <x, col2im(y)>.
            let y: Vec<f32> = (0..cols.len()).map(|i| ((i * 7) % 11) as f32).collect();
            let mut back = vec![0.0; input.len()];
            col2im(&g, &y, 2, &mut back);
            let lhs: f64 = cols.iter().zip(&y).map(|(a, b)| f64::from(a * b)).sum();
            let rhs: f64 = input.iter().zip(&back).map(|(a, b)| f64::from(a * b)).sum();
            assert_eq!(lhs, rhs);
        }
    }
}
