package kvevents

import (
	"bytes"
	"fmt"
	"unsafe"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// decoder reads one payload. Every length the payload claims is checked
// against the bytes left in it before anything is made for it, and a value
// that is not read is skipped without recursion: a payload costs no more
// than what it holds, never what it claims, however it is cut or nested.
// What it holds is bounded too: the values read from it (events, hashes,
// token ids, extra keys) may take at most maxDecodedPerByte times its size,
// so that a payload of millions of tiny elements cannot take hundreds of
// times its size in memory.
type decoder struct {
	*msgpack.Decoder
	r       *bytes.Reader // the Decoder reads it unbuffered: r.Len() is what is left
	payload []byte
	left    *int // bytes its values may still take, shared with the decoders of its parts
}

// maxDecodedPerByte bounds what a payload's values take decoded, per byte of
// it: vLLM's take less (a BlockRemoved of one small hash, some 16 bytes, is
// an Event of 184; a token id of one byte, 8).
const maxDecodedPerByte = 16

var errTooCostly = fmt.Errorf("the payload's values take more than %d times its size", maxDecodedPerByte)

func newDecoder(payload []byte) *decoder {
	r := bytes.NewReader(payload)
	left := maxDecodedPerByte*len(payload) + 4<<10
	return &decoder{Decoder: msgpack.NewDecoder(r), r: r, payload: payload, left: &left}
}

// part is a decoder of raw, a part of d's payload, within d's budget.
func (d *decoder) part(raw []byte) *decoder {
	p := newDecoder(raw)
	p.left = d.left
	return p
}

// charge counts n bytes of decoded values against the payload's budget.
func (d *decoder) charge(n int) error {
	if *d.left -= n; *d.left < 0 {
		return errTooCostly
	}
	return nil
}

// reset makes d read payload, reusing what it holds.
func (d *decoder) reset(payload []byte) {
	d.r.Reset(payload)
	d.Decoder.Reset(d.r)
	d.payload = payload
}

// arrayLen reads an array's length (-1 for nil): at most a byte left per
// element.
func (d *decoder) arrayLen() (int, error) {
	n, err := d.DecodeArrayLen()
	if err == nil && n > d.r.Len() {
		err = fmt.Errorf("an array of %d in %d bytes", n, d.r.Len())
	}
	return n, err
}

// mapLen reads a map's length (-1 for nil): at most two bytes left per entry.
func (d *decoder) mapLen() (int, error) {
	n, err := d.DecodeMapLen()
	if err == nil && n > d.r.Len()/2 {
		err = fmt.Errorf("a map of %d in %d bytes", n, d.r.Len())
	}
	return n, err
}

// skip skips the next value, containers by counting what is left of them.
func (d *decoder) skip() error {
	for pending := 1; pending > 0; pending-- {
		c, err := d.PeekCode()
		if err != nil {
			return err
		}
		var n int
		switch {
		case isArray(c):
			n, err = d.arrayLen()
		case isMap(c):
			n, err = d.mapLen()
			n *= 2
		default: // a scalar, string, binary or extension
			err = d.Skip()
		}
		if err != nil {
			return err
		}
		pending += max(n, 0)
	}
	return nil
}

// raw skips the next value and returns its msgpack.
func (d *decoder) raw() ([]byte, error) {
	start := len(d.payload) - d.r.Len()
	if err := d.skip(); err != nil {
		return nil, err
	}
	return d.payload[start : len(d.payload)-d.r.Len()], nil
}

// bytes reads a binary or string value, at most what is left.
func (d *decoder) bytes() ([]byte, error) {
	n, err := d.DecodeBytesLen()
	if err != nil || n < 0 {
		return nil, err
	}
	if n > d.r.Len() {
		return nil, fmt.Errorf("%d bytes in %d", n, d.r.Len())
	}
	b := make([]byte, n)
	return b, d.ReadFull(b)
}

// preallocated caps what is made ahead for n elements claimed: the rest
// grows as they are read.
const preallocated = 1024

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isNil(d *decoder) (bool, error) {
	c, err := d.PeekCode()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		return true, d.DecodeNil()
	}
	return false, nil
}

// readList reads an array (nil: none) whose elements read reads.
func readList[T any](d *decoder, read func() (T, error)) ([]T, error) {
	n, err := d.arrayLen()
	if err != nil || n < 0 {
		return nil, err
	}
	var zero T
	if err := d.charge(n * int(unsafe.Sizeof(zero))); err != nil { // before anything is made for them
		return nil, err
	}
	out := make([]T, 0, min(n, preallocated))
	for range n {
		v, err := read()
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// readStruct reads a msgspec struct written either as a map of its fields or
// as an array of them in order, calling field for each: with its name and -1
// from a map, or with "" and its position from an array.
func readStruct(d *decoder, field func(name string, i int) error) error {
	c, err := d.PeekCode()
	if err != nil {
		return err
	}
	if isMap(c) {
		n, err := d.mapLen()
		if err != nil {
			return err
		}
		for range n {
			name, err := d.DecodeString()
			if err != nil {
				return err
			}
			if err := field(name, -1); err != nil {
				return err
			}
		}
		return nil
	}
	n, err := d.arrayLen()
	if err != nil {
		return err
	}
	for i := range n {
		if err := field("", i); err != nil {
			return err
		}
	}
	return nil
}

func readOptionalString(d *decoder) (string, error) {
	if null, err := isNil(d); null || err != nil {
		return "", err
	}
	return d.DecodeString()
}
