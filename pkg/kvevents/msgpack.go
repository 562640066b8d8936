package kvevents

import (
	"bytes"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// decoder reads one payload. Every length the payload claims is checked
// against the bytes left in it before anything is made for it, and a value
// that is not read is skipped without recursion: a payload costs about its
// own size, never what it claims, however it is cut or nested.
type decoder struct {
	*msgpack.Decoder
	r       *bytes.Reader // the Decoder reads it unbuffered: r.Len() is what is left
	payload []byte
}

func newDecoder(payload []byte) *decoder {
	r := bytes.NewReader(payload)
	return &decoder{Decoder: msgpack.NewDecoder(r), r: r, payload: payload}
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
