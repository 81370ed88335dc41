/* One call into libjpeg (libjpeg-turbo's libjpeg API, libjpeg.so.62): a rectangle of a
 * baseline YCbCr JPEG decoded to RGBX, the columns left of it and the rows below it never
 * through the IDCT, upsampling or colour conversion (jpeg_crop_scanline, jpeg_skip_scanlines).
 * TurboJPEG 2.1, which the rest of larder decodes with, has no partial decode.
 *
 * libjpeg reports errors by calling error_exit, which must not return: here it longjmps back
 * into this file, which turns it into a return code. No Rust frame lies between the setjmp
 * and the longjmp (the caller's frame is below the setjmp), so nothing unwinds through Rust. */

#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

/* What larder_jpeg_region returns. */
#define REGION_OK 0
#define REGION_FAILED 1
/* A JPEG this call does not decode (not 3-component YCbCr, progressive, arithmetic-coded):
 * the caller decodes it whole instead. */
#define REGION_NOT_HERE 2

struct errors {
    struct jpeg_error_mgr mgr;
    jmp_buf back;
    char *msg;
    size_t msg_len;
    int warned;
    /* A warning that says the data ended before the image did (rows missing). */
    int truncated;
};

static void on_error(j_common_ptr c) {
    struct errors *e = (struct errors *)c->err;
    char text[JMSG_LENGTH_MAX];
    (*c->err->format_message)(c, text);
    snprintf(e->msg, e->msg_len, "%s", text);
    longjmp(e->back, 1);
}

/* Warnings (level -1) are kept, the first one's text for the caller; trace messages dropped. */
static void on_message(j_common_ptr c, int level) {
    struct errors *e = (struct errors *)c->err;
    if (level >= 0) {
        return;
    }
    c->err->num_warnings++;
    if (c->err->msg_code == JWRN_JPEG_EOF || c->err->msg_code == JWRN_HIT_MARKER) {
        e->truncated = 1;
    }
    if (!e->warned) {
        char text[JMSG_LENGTH_MAX];
        (*c->err->format_message)(c, text);
        snprintf(e->msg, e->msg_len, "%s", text);
        e->warned = 1;
    }
}

/* Errors of `cinfo` reported through `err`: their text into `msg` (msg_len bytes), the
 * call's end through the caller's setjmp on err->back. */
static void report_to(struct jpeg_decompress_struct *cinfo, struct errors *err, char *msg,
                      size_t msg_len) {
    memset(err, 0, sizeof *err);
    err->msg = msg;
    err->msg_len = msg_len;
    cinfo->err = jpeg_std_error(&err->mgr);
    err->mgr.error_exit = on_error;
    err->mgr.emit_message = on_message;
}

/* A decompressor over the `len` bytes at `data`, its header read. */
static void open_header(struct jpeg_decompress_struct *cinfo, const unsigned char *data,
                        unsigned long len) {
    jpeg_create_decompress(cinfo);
    jpeg_mem_src(cinfo, data, len);
    jpeg_read_header(cinfo, TRUE);
}

/* The size of `data` (len bytes) as decoded at 1/denom (denom 1, 2, 4 or 8): *w, *h. */
int larder_jpeg_scaled_size(const unsigned char *data, unsigned long len, unsigned int denom,
                            unsigned int *w, unsigned int *h, char *msg, size_t msg_len) {
    struct jpeg_decompress_struct cinfo;
    struct errors err;
    report_to(&cinfo, &err, msg, msg_len);
    /* The longjmp of on_error lands here (this frame is live for every libjpeg call below). */
    if (setjmp(err.back)) {
        jpeg_destroy_decompress(&cinfo);
        return REGION_FAILED;
    }
    open_header(&cinfo, data, len);
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    jpeg_calc_output_dimensions(&cinfo);
    *w = cinfo.output_width;
    *h = cinfo.output_height;
    jpeg_destroy_decompress(&cinfo);
    return REGION_OK;
}

/* Decodes rows y0 .. y0 + rows and at least columns x0 .. x0 + cols of `data` (len bytes) at
 * 1/denom of its size, as RGBX, into `out` (rows x stride bytes). libjpeg starts the columns
 * at an iMCU boundary: *got_x is the first column decoded (<= x0) and *got_cols how many
 * (x0 + cols <= *got_x + *got_cols), which must fit `stride` / 4. The rows after the
 * rectangle are decoded too (skipped, then the last one read into `spare`, `stride` bytes:
 * skipping to the end alone decodes nothing), so a file cut short anywhere is found as a whole
 * decode finds it. *warnings: how many warnings libjpeg gave (the first one's text in `msg`);
 * *truncated: whether one of them said the data ended before the image did. */
int larder_jpeg_region(const unsigned char *data, unsigned long len, unsigned int denom,
                       unsigned int x0, unsigned int y0, unsigned int cols, unsigned int rows,
                       unsigned char *out, size_t stride, unsigned char *spare,
                       unsigned int *got_x, unsigned int *got_cols, int *warnings,
                       int *truncated, char *msg, size_t msg_len) {
    struct jpeg_decompress_struct cinfo;
    struct errors err;
    report_to(&cinfo, &err, msg, msg_len);
    /* The longjmp of on_error lands here (this frame is live for every libjpeg call below). */
    if (setjmp(err.back)) {
        jpeg_destroy_decompress(&cinfo);
        return REGION_FAILED;
    }
    open_header(&cinfo, data, len);
    if (cinfo.num_components != 3 || cinfo.jpeg_color_space != JCS_YCbCr ||
        cinfo.progressive_mode || cinfo.arith_code) {
        jpeg_destroy_decompress(&cinfo);
        return REGION_NOT_HERE;
    }
    cinfo.out_color_space = JCS_EXT_RGBX;
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    jpeg_start_decompress(&cinfo);
    if (x0 >= cinfo.output_width || y0 >= cinfo.output_height || cols == 0 || rows == 0 ||
        cols > cinfo.output_width - x0 || rows > cinfo.output_height - y0) {
        snprintf(msg, msg_len, "a region past the image's %ux%u", cinfo.output_width,
                 cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return REGION_FAILED;
    }
    JDIMENSION xoff = x0, width = cols;
    jpeg_crop_scanline(&cinfo, &xoff, &width);
    if ((size_t)width * 4 > stride || xoff + width < x0 + cols) {
        snprintf(msg, msg_len, "libjpeg's crop of %u columns from %u does not fit", width, xoff);
        jpeg_destroy_decompress(&cinfo);
        return REGION_FAILED;
    }
    *got_x = xoff;
    *got_cols = width;
    if (y0 > 0 && jpeg_skip_scanlines(&cinfo, y0) != y0) {
        snprintf(msg, msg_len, "the JPEG ends before row %u", y0);
        jpeg_destroy_decompress(&cinfo);
        return REGION_FAILED;
    }
    for (unsigned int r = 0; r < rows;) {
        JSAMPROW row = out + (size_t)r * stride;
        JDIMENSION n = jpeg_read_scanlines(&cinfo, &row, 1);
        if (n != 1) {
            snprintf(msg, msg_len, "the JPEG ends at row %u", y0 + r);
            jpeg_destroy_decompress(&cinfo);
            return REGION_FAILED;
        }
        r += n;
    }
    JDIMENSION left = cinfo.output_height - cinfo.output_scanline;
    if (left > 1) {
        jpeg_skip_scanlines(&cinfo, left - 1);
    }
    if (left > 0) {
        JSAMPROW row = spare;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    *warnings = (int)err.mgr.num_warnings;
    *truncated = err.truncated;
    jpeg_destroy_decompress(&cinfo);
    return REGION_OK;
}
